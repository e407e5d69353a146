"""A Qwen3-30B-A3B-shaped mixture of experts: 48 layers, d_model 2048, 32 query heads on 4 key/value
heads of width 128 with the q/k RMSNorm, 128 experts of width 768 a layer, 8 a token (renormalised),
vocabulary 151,936 (a Qwen3 tokenizer: --config.data.tokenizer=DIR). About 30B parameters, 3B active.

    python -m gspmd_tp.plan --config=configs/qwen3_30b_a3b.py --target=tpu:v5p:4x4x4
    python train.py --config=configs/qwen3_30b_a3b.py --workdir=gs://BUCKET/qwen3_moe --distributed

Expert parallelism with FSDP (rules/expert_fsdp.yaml): the experts over `expert`, every other weight
sharded over both axes; on 64 chips data=8,expert=8 holds 16 experts a chip. The ragged dispatch's
receive buffers are the worst case's (dropless); --config.model.moe_buffer_factor=2 sizes them at
twice the balanced load (docs/estimates.md: 39,798 against 54,722 MiB a chip, a third of the exchange's
bytes), leaving out and counting (expert_dropped) what a busier chip cannot hold.
"""

from gspmd_tp.configs import tiny


def get_config():
    c = tiny.get_config()
    c.mesh = "data=-1,expert=8"
    c.rules = "expert_fsdp"
    c.steps = 100_000
    c.batch_size = 256
    c.seq_len = 4096
    c.log_every = 20
    c.eval_every = 1000
    c.eval_batches = 8
    c.checkpoint_every = 1000
    c.host_device_count = 0  # real devices only

    c.model.vocab_size = 151_936
    c.model.d_model = 2048
    c.model.num_layers = 48
    c.model.num_heads = 32
    c.model.num_kv_heads = 4
    c.model.head_dim = 128
    c.model.mlp_dim = 6144  # unused by the experts (expert_mlp_dim); Qwen3-30B-A3B's dense width
    c.model.rope_theta = 1_000_000.0
    c.model.norm_eps = 1e-6
    c.model.qk_norm = True
    c.model.tie_embeddings = False
    c.model.dtype = "bfloat16"
    c.model.attention = "auto"
    c.model.remat = "full"
    c.model.num_experts = 128
    c.model.experts_per_token = 8
    c.model.expert_mlp_dim = 768
    c.model.router_renormalize = True  # Qwen3-MoE's norm_topk_prob
    c.model.router_aux_loss_coef = 0.001  # Qwen3-MoE's router_aux_loss_coef

    c.optim.lr = 3e-4
    c.optim.warmup_steps = 2000
    return c
