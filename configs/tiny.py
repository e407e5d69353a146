"""Tiny Llama-style model on the embedded default corpus; the CPU default (8 simulated devices).

    python train.py --config=configs/tiny.py --workdir=runs/tiny

Takes a few minutes on 2 CPU cores. Override any key: --config.rules=megatron_1d --config.mesh=dp=4,mp=2
"""

from ml_collections import ConfigDict


def get_config() -> ConfigDict:
    c = ConfigDict()
    c.mesh = "dp=2,mp=4"  # mesh axis sizes; one may be -1 (fills the remaining devices)
    c.rules = "megatron_2d"  # a name under rules/ or a path to a rule file
    c.steps = 300
    c.batch_size = 16  # global, in sequences
    c.grad_accum = 1  # microbatches per step (the step still sees batch_size sequences)
    # > 0: compute the logits this many positions at a time (large vocabularies); must divide seq_len
    c.loss_chunk = 0
    c.seq_len = 128
    # auto | none | collective_matmul: whether the TPU and GPU compilers split tensor parallelism's
    # all-gathers and reduce-scatters into collective-permutes overlapped with the partial products
    # of the matmul they feed (collective matmul, windowed einsum). auto: the compiler's own choice
    # (on TPU, large products only); none: never; collective_matmul: every one it can. No effect on
    # CPU. docs/plan.md#overlap
    c.overlap = "auto"
    c.seed = 0
    c.log_every = 25
    c.eval_every = 100
    c.eval_batches = 4  # held-out batches per evaluation (at most one pass over the held-out split)
    c.checkpoint_every = 100
    c.keep_checkpoints = 3
    # Simulated devices when running on the CPU; set before jax is imported. A device count the
    # caller already put in XLA_FLAGS wins. Ignored by accelerators.
    c.host_device_count = 8
    # With simulated devices: glibc malloc keeps freed memory for reuse (gspmd_tp/job/host_devices.py).
    c.host_malloc_tuning = True
    c.peak_flops_per_device = 0.0  # > 0 overrides the per-device peak used for MFU
    # False: a NaN/Inf loss or gradient stops the run (the last good checkpoint stays the newest).
    # True: such a step keeps the old parameters and optimizer state and training goes on (a whole
    # checkpoint interval of such steps stops it: the run has diverged).
    c.skip_nonfinite_steps = False
    # An .npz from `python -m gspmd_tp.checkpoint export`: the initial parameters of a fresh run
    # on any mesh and rule file (ignored when the workdir already holds a checkpoint).
    c.init_from = ""
    # > 0: trace that many training steps with jax.profiler into WORKDIR/profile (ui.perfetto.dev
    # opens the .trace.json.gz; TensorBoard's profile plugin reads the directory) and log where their
    # device time went.
    # The first skip_steps steps of this start (a resume's too) stay out of it: warm-up, not steady state.
    c.profile = ConfigDict()
    c.profile.steps = 0
    c.profile.skip_steps = 3
    # True: also trace the Python functions each thread calls (host detail, at a cost to the traced
    # steps' dispatch).
    c.profile.python = False

    c.model = ConfigDict()
    # byte tokens; a multiple of 128 shards on any mp up to 128. 0: data.tokenizer's size rounded up
    # to a multiple of 128, the padding masked out of the softmax
    c.model.vocab_size = 256
    c.model.d_model = 128
    c.model.num_layers = 4
    c.model.num_heads = 8
    c.model.num_kv_heads = 8  # < num_heads gives grouped key/value heads; must divide by mp
    c.model.head_dim = 16
    c.model.mlp_dim = 512
    c.model.rope_theta = 10000.0
    c.model.norm_eps = 1e-5
    c.model.tie_embeddings = False
    # Qwen3's query/key RMSNorm over head_dim before rotary embedding (docs/model.md); False: none.
    c.model.qk_norm = False
    c.model.dtype = "float32"  # on CPU bf16 matmuls are slower than f32
    # none | full | dots | dots_no_batch | dots_no_batch_comm | dots_no_batch_attention
    c.model.remat = "none"
    # Activations also kept under the remat policy, comma-separated: attn_in, attn_out, mlp_in,
    # mlp_out, query, key, mlp_hidden, weights (more memory, fewer elementwise passes recomputed)
    c.model.remat_save = ""
    # einsum | xla | cudnn (jax.nn.dot_product_attention; cudnn: GPU, bf16) | auto (cudnn on GPU in
    # bf16, einsum elsewhere). On CPU xla is no faster.
    c.model.attention = "einsum"
    # einsum only: queries in blocks of this many positions, each scoring only the keys up to its
    # end (skips the masked upper triangle; exact). 0: the whole square at once.
    c.model.attention_block = 0
    # all_gather | ring: under a rule file that splits length over mesh axes (context parallelism:
    # context_dp, fsdp_context_tensor), how attention reaches the other devices' keys and values.
    # all_gather: gathered whole (GSPMD's); ring: passed round the context axis by ppermute, one
    # block a step beside the products on the one before, under a streaming softmax (einsum blocks:
    # model.attention einsum or auto, model.attention_block 0). No context axis: plain attention.
    c.model.context_parallel = "all_gather"
    # Under context parallelism: each sequence laid out in zigzag order (device i of n holds chunks
    # i and 2n-1-i of 2n), so every device does the same causal attention work; seq_len must divide
    # by 2n. False: device i holds chunk i (the last device's queries see every key, the first's few).
    c.model.context_load_balance = False
    c.model.scan_layers = True
    # auto | fused | one_pass | xla: the SwiGLU MLP's gradient (auto: fused on GPU where mlp is not
    # split over a mesh axis, one_pass on other GPU runs, xla elsewhere)
    c.model.mlp_grad = "auto"
    # > 1: where the rule file splits the MLP's weights on the model width (megatron_2d, fsdp_tp,
    # fsdp, data_fsdp_tensor), gather them in this many slices of the mlp dimension, each beside
    # the products of the one before (docs/plan.md#overlap). 1: whole gathers, GSPMD's.
    c.model.mlp_slices = 1
    # Mixture of experts (docs/model.md#mixture-of-experts). 0: the dense MLP. > 0: each block's MLP
    # is that many SwiGLU experts of width expert_mlp_dim (0: mlp_dim), experts_per_token a token
    c.model.num_experts = 0
    c.model.experts_per_token = 2
    c.model.expert_mlp_dim = 0
    c.model.shared_experts = 0  # > 0: a dense MLP of that many experts' width every token goes through
    c.model.router_renormalize = True  # the k weights renormalised to sum to 1 (Mixtral)
    c.model.router_aux_loss_coef = 0.01  # Switch's load-balancing loss (1 when balanced)
    c.model.router_z_loss_coef = 0.001  # ST-MoE's router z-loss
    # auto | gather | ragged: how tokens reach their experts' devices where the rule file splits
    # experts. gather: all-gathered over the expert group, outputs reduce-scattered back; ragged:
    # each sent to its experts' devices and back (ragged_all_to_all; TPU and GPU only, XLA:CPU has
    # none). auto: ragged on TPU and GPU, gather on CPU.
    c.model.moe_dispatch = "auto"
    # The ragged dispatch's receive buffer per device: 0, the worst case (every token of the expert
    # group sent to one device: dropless); >= 1, that many times the balanced load, smaller buffers
    # and less sent back; assignments past a full buffer are left out, counted in expert_dropped.
    c.model.moe_buffer_factor = 0.0

    c.optim = ConfigDict()
    c.optim.lr = 3e-3  # small model, short run: a high peak rate
    c.optim.warmup_steps = 30
    c.optim.min_lr_ratio = 0.1
    c.optim.b1 = 0.9
    c.optim.b2 = 0.95
    c.optim.eps = 1e-8
    c.optim.weight_decay = 0.1
    c.optim.clip_norm = 1.0  # global gradient norm; 0: no clipping
    # float32 | bfloat16: AdamW's first moment (mu). bfloat16 halves its memory and the bytes the
    # update moves for it; the second moment (nu) stays float32, whose range and precision it needs.
    c.optim.mu_dtype = "float32"
    # float32 | bfloat16: the data-parallel gradient reduction (parameters and optimizer state stay
    # float32). bfloat16 halves the bytes it sends, at the cost of rounding each gradient once: for
    # large dp groups on a slow network (docs/training.md#communication-dtype).
    c.optim.grad_reduce_dtype = "float32"

    c.data = ConfigDict()
    c.data.train_files = ""  # comma-separated globs of .txt/.jsonl; empty = the Python stdlib sources
    c.data.eval_files = ""  # empty = a held-out split of the training documents
    c.data.eval_fraction = 0.05  # in (0, 1): documents held out by a hash of their name (not with eval_files)
    c.data.jsonl_field = "text"
    c.data.parquet_column = "text"  # the text of a parquet file's rows (python -m gspmd_tp.data.prepare)
    # A directory of shards made by python -m gspmd_tp.data.prepare: both splits, read from disk as
    # the batches need them (train_files and eval_files stay empty).
    # docs/data.md#shards-a-corpus-larger-than-memory
    c.data.shards = ""
    # bytes | a Hugging Face tokenizer.json or model directory | a SentencePiece .model
    # (docs/data.md#tokenizers)
    c.data.tokenizer = "bytes"
    # Processes that tokenize the files at the start (grain workers); 0: this process.
    c.data.workers = 0
    c.data.seed = 0  # shuffle seed
    # Windows are packed from documents end to end. True: attention stays within each document and
    # rotary positions restart at each (segment ids and positions from the separators between
    # documents, as MaxText and seqio packing give). False: a window is one sequence, attended whole.
    c.data.document_mask = True
    # Batches read and placed ahead on a background thread. -1: 2 on accelerators, 0 on CPU, where
    # reading is cheap and the thread only competes with the step (measured 4% slower on tiny). At most
    # 1000, and 1 GiB of batches (data.max_prefetch).
    c.data.prefetch = -1
    # Locked: the configs that start from this one set only keys it has. A key set or deleted that
    # is not among them (a misspelling) is refused, with ml_collections' suggestion of the key meant.
    return c.lock()
