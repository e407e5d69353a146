"""GPT-2 small shape (12 layers, d_model 768, 12 heads) as a Llama-style model; for accelerators.

    python train.py --config=configs/gpt2_small.py --workdir=runs/gpt2_small

With byte tokens (vocab 256) it has 113M parameters; GPT-2's 50,257-token vocabulary would make it
152M (GPT-2's own 124M has a 4x GELU MLP where this one has SwiGLU).
Defaults to FSDP over every device (mesh dp=-1,mp=1), which fits any device count; for Megatron
tensor parallelism inside a host: --config.rules=megatron_1d --config.mesh=dp=-1,mp=4 (12 heads
divide by 2, 4, 6 or 12).
"""

from gspmd_tp.configs import tiny


def get_config():
    c = tiny.get_config()
    c.mesh = "dp=-1,mp=1"
    c.rules = "fsdp"
    c.steps = 20_000
    c.batch_size = 64
    c.seq_len = 1024
    c.log_every = 50
    c.eval_every = 1000
    c.eval_batches = 16
    c.checkpoint_every = 1000
    c.host_device_count = 0  # real devices only

    c.model.d_model = 768
    c.model.num_layers = 12
    c.model.num_heads = 12
    c.model.num_kv_heads = 12
    c.model.head_dim = 64
    c.model.mlp_dim = 3072
    c.model.tie_embeddings = True
    c.model.dtype = "bfloat16"
    c.model.remat = "dots_no_batch"

    c.optim.lr = 6e-4
    c.optim.warmup_steps = 1000
    return c
