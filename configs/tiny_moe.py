"""configs/tiny.py as a mixture of experts: 8 SwiGLU experts a layer, 2 a token, under expert
parallelism (rules/expert_fsdp.yaml on data=2,expert=4: 2 experts a device, the other weights fully
sharded). Trains on the embedded default corpus on CPU in minutes (8 simulated devices).

    python train.py --config=configs/tiny_moe.py --workdir=runs/tiny_moe

metrics.jsonl's router_aux_loss (1 when balanced) and expert_max_load (the largest expert's share of
the tokens over the mean share) say how evenly the router spreads the tokens. Override any key, e.g.
--config.rules=data_expert_tensor --config.mesh=data=2,expert=2,tensor=2.
"""

from gspmd_tp.configs import tiny


def get_config():
    c = tiny.get_config()
    c.mesh = "data=2,expert=4"
    c.rules = "expert_fsdp"
    c.steps = 200
    c.eval_every = 100
    # Each expert a quarter of tiny's MLP, two a token: half its active MLP width, four times its
    # MLP parameters (8 x 128 against 512).
    c.model.num_experts = 8
    c.model.experts_per_token = 2
    c.model.expert_mlp_dim = 128
    c.model.shared_experts = 0  # > 0: a dense MLP of that many experts' width every token goes through
    c.model.router_renormalize = True  # the k weights renormalised to sum to 1 (Mixtral)
    # Switch's load-balancing loss (1 when balanced): ten times the library default, which left the
    # largest expert of the worst layer at 2.6x the mean share after 200 steps
    c.model.router_aux_loss_coef = 0.1
    c.model.router_z_loss_coef = 0.001  # ST-MoE's router z-loss
    return c
