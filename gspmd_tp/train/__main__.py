"""Train a transformer whose sharding is a rule file.

python -m gspmd_tp.train --config=tiny --workdir=runs/tiny [--config.KEY=VALUE ...]
python train.py --config=configs/tiny.py --workdir=runs/tiny    # the same, in a checkout
"""

if __name__ == "__main__":
    from gspmd_tp.job import entry

    entry.begin()  # main() asks for the config's devices; signals.run_job then takes Ctrl-C over

from absl import app, flags

from gspmd_tp.cli import arguments
from gspmd_tp.cli.arguments import define_config, parse_flags
from gspmd_tp.job import entry, job_flags

_CONFIG = define_config("tiny", "A config file, or the name of a shipped one (configs/NAME.py).")
_WORKDIR = arguments.define_path("workdir", None, "Run directory: checkpoints, metrics, events.")
flags.mark_flags_as_required(["workdir"])
job_flags.define()
flags.adopt_module_key_flags(job_flags)


def main(argv):
    arguments.no_positional_arguments(argv)
    entry.start_job(config := _CONFIG.value)
    from gspmd_tp.job import signals

    def job():
        from gspmd_tp.train.loop import train

        job_flags.join()
        train(config, _WORKDIR.value)

    signals.run_job(job)


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
