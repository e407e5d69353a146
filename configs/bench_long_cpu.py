"""A long-sequence CPU benchmark of context parallelism: configs/tiny.py's model (4 layers, d_model
128, 8 heads) at 4,096 positions, 8 sequences a step, against cp = 1 (plain data parallelism).

    for m in data=8,context=1 data=4,context=2 data=2,context=4 data=1,context=8; do
        python bench.py --config=configs/bench_long_cpu.py --meshes=$m --steps=3 --warmup=1
    done  # and configs/bench_long_cpu.py:ring on the three meshes with context > 1

One mesh a run: the host holds up to 2.3x a compiled step's memory (the tuned heap), so --alternate
over the four would need more than a 24 GB host, and bench refuses it. The table, its figures and
what they show: docs/benchmarks.md (Long sequences).

rules/context_dp.yaml on data=8/cp,context=cp: cp = 1 is plain data parallelism (a whole sequence a
device), cp > 1 splits each sequence over cp devices (the same 4,096 tokens a device). The argument
is config.model.context_parallel: all_gather (the default: the keys and values gathered, scored in
query blocks of 512) or ring (the blocks passed round the context axis, one block a step; cp = 1
runs plain attention whole).
"""

from gspmd_tp.configs import tiny


def get_config(strategy: str = "all_gather"):
    c = tiny.get_config()
    c.mesh = "data=2,context=4"
    c.rules = "context_dp"
    c.batch_size = 8  # one sequence a device at cp = 1
    c.seq_len = 4096
    c.model.context_parallel = strategy
    # all_gather: query blocks of 512, the score square in eighths, not whole (1 GiB of float32 a
    # sequence). The ring computes a block a step itself, and takes no query blocks.
    c.model.attention_block = 512 if strategy == "all_gather" else 0
    # Each layer recomputed in the backward pass: one layer's scores live at a time, so that cp = 1
    # fits 8 devices in a small host's memory (its step needs 3.4 GiB a device with no remat).
    c.model.remat = "full"
    return c
