"""A ~1B-parameter Llama-3.2-1B-shaped model (16 layers, d_model 2048, 32 heads, 8 kv heads).

    python train.py --config=configs/llama_1b.py --workdir=runs/llama_1b

For accelerators: bfloat16 compute, cuDNN's fused attention on GPU (with
--config.data.document_mask=False: cuDNN cannot mask packed documents apart, and they take the
einsum path; docs/model.md#attention), layers unrolled,
rematerialization that keeps matmul outputs and the attention's, and (model.mlp_grad auto) the MLP's
backward written out on GPU; FSDP over every device by default
(--config.rules=megatron_1d --config.mesh=dp=-1,mp=8 for tensor parallelism inside a host). With
byte tokens it has 0.97B parameters. On one H100 it needs XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
(docs/benchmarks.md, "One H100 GPU").
"""

from gspmd_tp.configs import tiny


def get_config():
    c = tiny.get_config()
    c.mesh = "dp=-1,mp=1"
    c.rules = "fsdp"
    c.steps = 50_000
    c.batch_size = 32
    c.seq_len = 2048
    c.log_every = 20
    c.eval_every = 1000
    c.eval_batches = 8
    c.checkpoint_every = 1000
    c.host_device_count = 0  # real devices only

    c.model.d_model = 2048
    c.model.num_layers = 16
    c.model.num_heads = 32
    c.model.num_kv_heads = 8
    c.model.head_dim = 64
    c.model.mlp_dim = 8192
    c.model.rope_theta = 500_000.0
    c.model.tie_embeddings = True
    c.model.dtype = "bfloat16"
    c.model.attention = "auto"  # cudnn on GPU (unmasked windows), einsum under data.document_mask
    # Unrolled: faster on an H100 than under the layer scan (docs/benchmarks.md).
    c.model.scan_layers = False
    c.model.remat = "dots_no_batch_attention"

    c.optim.lr = 3e-4
    c.optim.warmup_steps = 2000
    return c
