"""Benchmark the train step for a config over rule files and meshes (python -m gspmd_tp.bench, or
bench.py in a checkout).

    python bench.py --config=configs/bench_cpu.py --rules=megatron_1d \
        --meshes="dp=8,mp=1 dp=2,mp=4" [--steps=10 --warmup=3 --json --json_out=FILE]
    python bench.py --config=configs/bench_cpu.py --meshes="dp=8,mp=1" \
        --variants="model.remat=none;model.attention_block=128" [--rounds=5 --round_steps=3]
    python bench.py --config=configs/bench_cpu.py --rules=dp,megatron_1d \
        --meshes="dp=8,mp=1 dp=2,mp=4" --alternate [--rounds=5 --round_steps=3]

On a pod or cluster, every process runs the same command with train.py's job flags
(--coordinator_address, --num_processes, --process_id; or --distributed); process 0 prints the
report and writes --json_out.
"""

if __name__ == "__main__":
    from gspmd_tp.job import entry

    entry.begin()  # main() asks for the config's devices; signals.run_job then takes Ctrl-C over

from absl import app, flags

from gspmd_tp.cli import arguments
from gspmd_tp.cli.arguments import define_config, parse_flags
from gspmd_tp.job import entry, job_flags
from gspmd_tp.job.errors import UserError

_CONFIG = define_config("bench_cpu", "A config file, or the name of a shipped one (configs/NAME.py).")
_RULES = flags.DEFINE_string("rules", "", "Comma-separated rule files, each once (default: config.rules).")
_MESHES = flags.DEFINE_string("meshes", "", "Space-separated meshes, each once (default: config.mesh).")
_STEPS = flags.DEFINE_integer("steps", 10, "Timed steps (median, min and max are reported).")
_WARMUP = flags.DEFINE_integer(
    "warmup", 15, "Untimed steps after compiling (CPU: the tuned malloc heap settles in ~10 to 15)."
)
_JSON = flags.DEFINE_bool("json", False, "Print one JSON object instead of the table.")
_JSON_OUT = arguments.define_path("json_out", "", "Also write the JSON report to this file.")
_PROFILE = arguments.define_path(
    "profile_dir", "", "Also trace one step per rule file x mesh here and report where its time goes."
)

_PHASES = flags.DEFINE_bool(
    "phases", False, "Also time the forward pass and the gradient alone: forward / backward / optimizer."
)
_VARIANTS = flags.DEFINE_string(
    "variants",
    "",
    "Time the config against variants of it instead, in alternating rounds (--rounds x "
    "--round_steps timed steps each, in place of --steps): sets of config overrides, ';' between "
    "sets, ',' inside one (model.remat=none;model.attention_block=128); an item with no '=' "
    "continues the value before it (model.remat_save=attn_in,mlp_in).",
)
_ALTERNATE = flags.DEFINE_bool(
    "alternate",
    False,
    "Time the rule files x meshes against one another in alternating rounds (--rounds x "
    "--round_steps timed steps each, in place of --steps), all compiled and held in memory at "
    "once, instead of one after another: a busy spell of a shared machine lands on all of them.",
)
_ROUNDS = flags.DEFINE_integer("rounds", 5, "With --variants or --alternate: alternating rounds.")
_ROUND_STEPS = flags.DEFINE_integer("round_steps", 3, "With --variants or --alternate: steps per round.")
job_flags.define()
flags.adopt_module_key_flags(job_flags)


def main(argv):
    arguments.no_positional_arguments(argv)
    entry.start_job(config := _CONFIG.value)
    from gspmd_tp.job import signals

    rules = [r.strip() for r in _RULES.value.split(",")] if _RULES.value else [config.rules]
    meshes = _MESHES.value.split() if _MESHES.value else [config.mesh]

    def job():
        import jax

        from gspmd_tp.bench import benchmark
        from gspmd_tp.job import distributed, job_flags
        from gspmd_tp.storage import outputs

        def checked():
            if not all(rules):  # as plan's --compare: "a, b" is two names, "a,,b" a mistake
                raise UserError(f"--rules={_RULES.value}: an empty rule file name (comma-separated names)")
            # Probed by writing: the file write, or the profiler, must not fail only after every
            # rule file x mesh has been timed. The report is process 0's to write; each writes its
            # traces.
            if _JSON_OUT.value and jax.process_index() == 0:
                outputs.check_file(_JSON_OUT.value, "--json_out", probe=True)
            if _PROFILE.value:
                outputs.check_dir(_PROFILE.value, "--profile_dir", probe=True)
            return benchmark.parse_variants(_VARIANTS.value) if _VARIANTS.value else None

        # stdout is the report's: gloo's lines, in a multi-process job on CPUs, go to stderr.
        with job_flags.stdout_to_stderr():
            job_flags.join()
            variants = distributed.agreed(checked)  # an error of one process stops every one
            report = benchmark.run(
                config,
                rules,
                meshes,
                _STEPS.value,
                _WARMUP.value,
                _PROFILE.value,
                _PHASES.value,
                variants,
                _ROUNDS.value,
                _ROUND_STEPS.value,
                _ALTERNATE.value,
            )
        if jax.process_index():
            return
        # Printed before the file is written: a write that fails after all the timing loses nothing.
        print(benchmark.to_json(report) if _JSON.value else benchmark.format_table(report), flush=True)
        if _JSON_OUT.value:
            try:
                with outputs.whole_file(_JSON_OUT.value) as partial, open(partial, "w") as f:
                    f.write(benchmark.to_json(report, indent=1))
            except OSError as e:
                raise UserError(f"--json_out={_JSON_OUT.value}: cannot write it ({e.strerror})") from None

    # What a stop (Ctrl-C, SIGTERM, a peer's death or error) leaves, in its one line.
    left = [f"--json_out={_JSON_OUT.value} is as it was"] if _JSON_OUT.value else []
    if _PROFILE.value:
        left.append(f"--profile_dir={_PROFILE.value} holds the traces taken before it")
    signals.run_job(
        job, before=f"({'; '.join(left) or 'nothing written'})", after="(after the report was written)"
    )


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
