"""A Llama-3-8B-shaped model (32 layers, d_model 4096, 32 heads on 8 kv heads, mlp 14,336, vocab
128,256): 8.03B parameters, for planning a cluster before renting it.

    python -m gspmd_tp.plan --config=configs/llama3_8b.py --target=tpu:v5p:8x8x2 \
        --config.rules=data_fsdp_tensor --config.mesh=data=2,fsdp=8,tensor=8
    python train.py --config=configs/llama3_8b.py --workdir=runs/llama3_8b

As configs/llama_1b.py: bfloat16 compute, cuDNN's fused attention on GPU, the same remat policy,
FSDP over every device by default. Layers under nn.scan, as MaxText runs them on TPUs: one layer to
compile whatever the depth. The vocabulary is Llama 3's
size, exact: it divides by any tensor axis up to 256 (data.tokenizer bytes uses the first 256 ids;
with Llama 3's tokenizer.json, model.vocab_size=0 pads its size to a multiple of 128). Global batch
128 sequences of 8,192 tokens (1M tokens a step, one sequence per chip on 128 chips).
Long context (docs/estimates.md, "Llama-3-8B at long context on v5p"): --config.seq_len=131072
--config.batch_size=2 --config.model.remat=full under context_dp or fsdp_context_tensor.
"""

from gspmd_tp.configs import llama_1b


def get_config():
    c = llama_1b.get_config()
    c.steps = 100_000
    c.batch_size = 128
    c.seq_len = 8192

    c.model.vocab_size = 128_256
    c.model.d_model = 4096
    c.model.num_layers = 32
    c.model.num_heads = 32
    c.model.num_kv_heads = 8
    c.model.head_dim = 128
    c.model.mlp_dim = 14_336
    c.model.tie_embeddings = False
    c.model.scan_layers = True
    return c
