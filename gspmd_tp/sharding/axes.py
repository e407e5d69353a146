"""The logical axis vocabulary: the only names the model uses for its dimensions.

Rule files map these names onto mesh axes. The model never names a mesh axis.

| name | where | meaning |
|---|---|---|
| `batch` | activations | global batch |
| `length` | activations in attention/MLP | sequence positions |
| `norm_length` | residual stream and norms | positions that sequence parallelism may shard |
| `embed` | params and activations | model width d_model |
| `heads` | params and activations | query heads |
| `kv_heads` | params and activations | key/value heads (query groups) |
| `head_dim` | params and activations | per-head width |
| `mlp` | params and activations | feed-forward hidden width |
| `vocab` | params and logits | vocabulary |
| `layers` | params | the stacked layer axis made by `nn.scan` |
| `experts` | params (MoE) | the expert dimension of the experts' weights and the router's |
| `kv_length` | activations inside attention | key/value positions, apart from the query's `length` |
"""

BATCH = "batch"
LENGTH = "length"
NORM_LENGTH = "norm_length"
EMBED = "embed"
HEADS = "heads"
KV_HEADS = "kv_heads"
HEAD_DIM = "head_dim"
MLP = "mlp"
VOCAB = "vocab"
LAYERS = "layers"
EXPERTS = "experts"
KV_LENGTH = "kv_length"

# name -> (where it appears, what it means); the table above in data form.
VOCABULARY: dict[str, tuple[str, str]] = {
    BATCH: ("activations", "global batch"),
    LENGTH: ("activations inside attention/MLP", "sequence positions"),
    NORM_LENGTH: (
        "residual stream and norms",
        "sequence positions where sequence parallelism may shard them",
    ),
    EMBED: ("params and activations", "model width d_model"),
    HEADS: ("params and activations", "attention (query) heads"),
    KV_HEADS: ("params and activations", "key/value heads"),
    HEAD_DIM: ("params and activations", "per-head width"),
    MLP: ("params and activations", "feed-forward hidden width"),
    VOCAB: ("params and logits", "vocabulary"),
    LAYERS: ("params", "the stacked layer axis made by nn.scan"),
    EXPERTS: ("params (MoE)", "the expert dimension of the experts' weights and the router's"),
    KV_LENGTH: (
        "activations inside attention",
        "key/value positions, apart from the query's length (context parallelism gathers them)",
    ),
}

# Names that appear on activations only (parameters are discovered from the model itself). `experts`
# names parameters only, so a dense model asks no rule file for it.
ACTIVATION_AXES = (BATCH, LENGTH, NORM_LENGTH, EMBED, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB, KV_LENGTH)
