"""The CPU benchmark model: 6 layers, d_model 256, 8 heads, length 256, vocabulary 8192, batch 16.

    python bench.py --config=configs/bench_cpu.py --rules=megatron_1d \
        --meshes="dp=8,mp=1 dp=4,mp=2 dp=2,mp=4 dp=1,mp=8"
"""

from gspmd_tp.configs import tiny


def get_config():
    c = tiny.get_config()
    c.mesh = "dp=2,mp=4"
    c.rules = "megatron_1d"
    c.batch_size = 16
    c.seq_len = 256
    c.model.vocab_size = 8192
    c.model.d_model = 256
    c.model.num_layers = 6
    c.model.num_heads = 8
    c.model.num_kv_heads = 8
    c.model.head_dim = 32
    c.model.mlp_dim = 1024
    c.model.dtype = "float32"  # on this CPU bf16 matmuls are slower than f32 (bench.py measures both)
    # Saving fewer activations is faster here (docs/benchmarks.md).
    c.model.remat = "dots_no_batch"
    # Four query blocks of 64: 5/8 of the score square instead of all of it (docs/benchmarks.md).
    c.model.attention_block = 64
    return c
