"""Rule files: the golden parameter -> PartitionSpec table per rule file, and every load error."""

import flax.linen as nn
import jax
import pytest
from conftest import small_config
from golden_tables import GOLDEN, MOE, SHIPPED, activation_names, activation_table, spec_table
from shipped_rules import mesh_for

from gspmd_tp.job.errors import UserError
from gspmd_tp.sharding.mesh import make_mesh
from gspmd_tp.sharding.rules import RULES_DIR, batch_mesh_axes, column_widths, load_rules, parse_rules
from gspmd_tp.train import run_setup

REGENERATE = "make golden (tests/sharding/golden_tables.py) rewrites it after an intended change"


def _golden(kind: str, rules_name: str) -> str:
    path = GOLDEN / f"{kind}_{rules_name}.txt"
    assert path.exists(), f"{path} is missing: {REGENERATE}"
    return path.read_text()


@pytest.mark.parametrize("rules_name", SHIPPED)
def test_golden_parameter_specs(rules_name):
    """Each parameter's PartitionSpec is the one checked in (tests/sharding/golden/specs_*.txt)."""
    assert spec_table(rules_name) == _golden("specs", rules_name), REGENERATE


@pytest.mark.parametrize("rules_name", SHIPPED)
def test_golden_parameter_specs_of_a_mixture_of_experts(rules_name):
    """The MoE model's parameters (router, experts, shared experts) under every rule file: experts
    over the expert axis where a file maps them, replicated where it gives [experts, null]."""
    assert spec_table(rules_name, **MOE) == _golden("specs_moe", rules_name), REGENERATE


@pytest.mark.parametrize("rules_name", SHIPPED)
def test_golden_activation_specs(rules_name):
    """Where each rule file places the activations the model constrains, forward and backward, is
    what is checked in (tests/sharding/golden/activations_*.txt)."""
    names = activation_names()
    assert ("batch", "length", "vocab") in names and len(names) >= 6  # the trace saw the model
    assert activation_table(rules_name) == _golden("activations", rules_name), REGENERATE


@pytest.mark.parametrize("rules_name", SHIPPED)
def test_optimizer_moments_follow_parameter_specs(rules_name):
    c = small_config(rules=rules_name, mesh=mesh_for(rules_name))
    s = run_setup.setup(c)
    param_specs = jax.tree.map(lambda x: x.spec, s.shardings.params)
    adam = s.shardings.opt_state[1][0]  # chain(clip, adamw): adamw's scale_by_adam state
    assert jax.tree.map(lambda x: x.spec, adam.mu) == param_specs
    assert jax.tree.map(lambda x: x.spec, adam.nu) == param_specs


def test_two_d_falls_back_to_the_free_axis():
    rules = load_rules("megatron_2d")
    assert rules.spec(("batch", "length", "embed")) == jax.sharding.PartitionSpec("dp", None, "mp")
    assert rules.spec(("embed", "mlp")) == jax.sharding.PartitionSpec("dp", "mp")
    assert rules.spec(("mlp", "embed")) == jax.sharding.PartitionSpec("mp", "dp")


@pytest.mark.parametrize("rules_name, expected", [("dp", ("dp", "mp")), ("megatron_2d", ("dp",))])
def test_batch_axes_are_the_mesh_axes_of_the_batch(rules_name, expected):
    rules = load_rules(rules_name)  # dp.yaml: [batch, [dp, mp]]; megatron_2d.yaml: [batch, dp]
    assert rules.batch_axes() == expected
    with nn.logical_axis_rules(rules.rules):  # as model and step code trace
        assert batch_mesh_axes() == expected


def test_column_widths_are_the_longest_entries_and_at_least_the_minimums():
    rows = [{"rules": "dp", "mesh": "dp=8"}, {"rules": "/a/long/rule_file.yaml", "mesh": "data=2,model=4"}]
    assert column_widths(rows, "rules", (16, 12)) == (22, 14)
    assert column_widths(rows[:1], "rules", (16, 12)) == (16, 12)
    assert column_widths([], "label", (14, 12)) == (14, 12)


def test_bare_name_and_path_load_the_same_rules():
    assert load_rules("megatron_1d").rules == load_rules(str(RULES_DIR / "megatron_1d.yaml")).rules


GOOD = """\
mesh_axes: [dp, mp]
rules:
  - [batch, dp]
  - [vocab, mp]
  - [heads, mp]
  - [kv_heads, mp]
  - [mlp, mp]
  - [embed, null]
  - [length, null]
  - [norm_length, null]
  - [kv_length, null]
  - [head_dim, null]
  - [layers, null]
"""


@pytest.mark.parametrize(
    "text, message",
    [
        ("mesh_axes: [dp, mp\nrules: []\n", r"bad\.yaml: malformed YAML at line"),
        (GOOD + "sharding: 2d\n", r"bad\.yaml: unknown key 'sharding'"),
        # Rules count from 1 and name their line: [mlp, mp] is the 5th rule, on line 7.
        (
            GOOD.replace("[mlp, mp]", "[mlp, tp]"),
            r"bad\.yaml: rule 5 \(line 7\) maps 'mlp' to mesh axis 'tp'",
        ),
        (GOOD.replace("[mlp, mp]", "[mlp, [dp, tp]]"), r"mesh axis 'tp', which is not in mesh_axes"),
        (
            GOOD.replace("[mlp, mp]", "[mpl, mp]"),
            r"bad\.yaml: rule 5 \(line 7\) names unknown logical axis 'mpl'",
        ),
        (GOOD.replace("[mlp, mp]", "mlp"), r"bad\.yaml: rule 5 \(line 7\) must be \[logical_axis"),
        (
            GOOD.replace("[heads, mp]", "[heads, [mp, mp]]"),
            r"bad\.yaml: rule 3 \(line 5\) \(heads\) names mesh axis 'mp' twice",
        ),
        (
            GOOD.replace("[batch, dp]", "[batch, [dp, mp, dp]]"),
            r"rule 1 \(line 3\) \(batch\) names mesh axis 'dp' twice",
        ),
        (
            "mesh_axes: [dp, mp]\nrules: [[batch, dp],\n  [vocab, tp]]\n",
            r"bad\.yaml: rule 2 \(line 3\) maps 'vocab' to mesh axis 'tp'",
        ),
        ("rules: []\n", r"bad\.yaml: missing key 'mesh_axes'"),
        # No mesh string could give such an axis its size ("dp=2,m,p=4" is three items).
        (
            GOOD.replace("mesh_axes: [dp, mp]", "mesh_axes: [dp, 'm,p']"),
            r"bad\.yaml: mesh axis 'm,p' in mesh_axes cannot be named in a mesh string",
        ),
        (
            GOOD.replace("mesh_axes: [dp, mp]", "mesh_axes: [dp, 'm p']"),
            r"mesh axis 'm p' in mesh_axes cannot",
        ),
        # A second rules: block pasted below the first would silently replace it.
        (GOOD + "rules:\n  - [batch, dp]\n", r"bad\.yaml: key 'rules' given twice \(again at line 14\)"),
        (GOOD.replace("[mlp, mp]", "{mlp: mp, mlp: dp}"), r"key 'mlp' given twice \(again at line 7\)"),
        ("- 1\n", r"bad\.yaml: expected a mapping"),
        # A rule shadowed by an earlier one for its logical axis would be dropped without a word.
        (
            GOOD.replace("  - [vocab, mp]\n", "  - [mlp, null]\n  - [vocab, mp]\n"),
            r"bad\.yaml: rule 6 \(line 8\) \[mlp, mp\] never applies: rule 2 \(line 4\) \[mlp, null\] "
            r"comes first and always applies",
        ),
        (
            GOOD.replace("  - [mlp, mp]\n", "  - [mlp, mp]\n  - [mlp, [dp, mp]]\n"),
            r"rule 6 \(line 8\) \[mlp, \[dp, mp\]\] never applies: rule 5 \(line 7\) \[mlp, mp\] comes first "
            r"and applies wherever this one could",
        ),
    ],
)
def test_rule_file_errors(text, message):
    with pytest.raises(UserError, match=message) as e:
        parse_rules(text, "bad.yaml")
    assert "\n" not in str(e.value)


def test_rule_file_that_is_not_utf8_is_one_line(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes((GOOD + "description: Megatron caf\u00e9\n").encode("latin-1"))
    with pytest.raises(UserError, match=r"latin1\.yaml: not UTF-8 text \(byte 0xe9 on line 14\)") as e:
        load_rules(str(path))
    assert "\n" not in str(e.value)


def test_uncovered_logical_axis_is_an_error(tmp_path):
    path = tmp_path / "partial.yaml"
    path.write_text(GOOD.replace("  - [head_dim, null]\n", ""))
    with pytest.raises(UserError, match=r"partial\.yaml: logical axis 'head_dim' is used by the model"):
        run_setup.setup(small_config(rules=str(path)))


def test_indivisible_parameter_names_path_shape_and_axes():
    c = small_config(rules="megatron_1d", mesh="dp=1,mp=8")
    c.model.mlp_dim = 100
    with pytest.raises(UserError, match=r"params/layers/mlp/down shape \(2, 100, 64\) .*mlp=100.* mp=8"):
        run_setup.setup(c)


def test_indivisible_batch_is_an_error():
    with pytest.raises(UserError, match=r"activation tokens .*batch=6.* dp=4"):
        run_setup.setup(small_config(batch_size=6, mesh="dp=4,mp=2"))


def test_indivisible_microbatch_names_batch_size_and_grad_accum():
    with pytest.raises(
        UserError, match=r"config.batch_size=16 / config.grad_accum=4 = 4 rows per microbatch .* dp=8"
    ):
        run_setup.setup(small_config(batch_size=16, grad_accum=4, rules="dp", mesh="dp=8,mp=1"))


def test_a_mesh_axis_that_shards_nothing_is_named_in_a_warning(tmp_path, capsys):
    path = tmp_path / "no_batch.yaml"
    path.write_text(GOOD.replace("[batch, dp]", "[batch, null]"))
    run_setup.setup(small_config(rules=str(path), mesh="dp=4,mp=2"))
    assert (
        "warning: mesh axis dp (4 devices) shards no parameter and no activation" in capsys.readouterr().err
    )
    run_setup.setup(small_config(rules="megatron_1d", mesh="dp=4,mp=2"))
    run_setup.setup(small_config(rules="megatron_1d", mesh="dp=8,mp=1"))  # mp has one device
    assert capsys.readouterr().err == ""


def test_a_mesh_axis_that_shards_parameters_but_no_activation_is_named_in_a_warning(tmp_path, capsys):
    # fsdp.yaml with the batch on dp alone: [embed, [dp, mp]] cannot apply in an activation (the
    # batch holds dp), so mp shards the weights only and its devices all repeat the same step.
    path = tmp_path / "fsdp_batch_dp.yaml"
    path.write_text((RULES_DIR / "fsdp.yaml").read_text().replace("[batch, [dp, mp]]", "[batch, dp]"))
    run_setup.setup(small_config(rules=str(path), mesh="dp=2,mp=4"))
    err = capsys.readouterr().err
    assert err.startswith(
        "warning: mesh axis mp (4 devices) shards parameters but no activation of the attention, MLP or "
        "output layer under "
    )
    assert err.strip().endswith(
        "all compute the same products (map batch or a hidden axis such as mlp to mp)"
    )
    assert "\n" not in err.strip()
    run_setup.setup(small_config(rules="fsdp", mesh="dp=2,mp=4"))
    assert capsys.readouterr().err == ""


def test_a_mesh_axis_that_shards_the_residual_stream_alone_is_named_in_a_warning(tmp_path, capsys):
    # Sequence parallelism on an axis of its own: the residual stream is split over sp and gathered
    # whole for attention and the MLP, which every sp device then computes alike (the compiled step
    # does 1.8x megatron_1d's FLOPs per device on the same 8 devices).
    path = tmp_path / "sp.yaml"
    text = (RULES_DIR / "megatron_1d.yaml").read_text().replace("[dp, mp]", "[dp, mp, sp]")
    path.write_text(text.replace("[norm_length, null]", "[norm_length, sp]"))
    run_setup.setup(small_config(rules=str(path), mesh="dp=2,mp=2,sp=2"))
    assert capsys.readouterr().err.startswith(
        "warning: mesh axis sp (2 devices) shards the residual stream but no activation of the attention"
    )
    run_setup.setup(small_config(rules="megatron_1d_sp", mesh="dp=2,mp=4"))  # sp on the heads' axis
    assert capsys.readouterr().err == ""


def test_a_weight_split_across_its_activations_slices_is_named_in_a_warning(tmp_path, capsys):
    # [mlp, [dp, mp]] then [mlp, mp]: the activations split mlp over mp, the weights over (dp, mp),
    # so a device's block of the weight (dp*4+mp of 8) is not inside its activations' (mp of 4).
    path = tmp_path / "mlp_both.yaml"
    text = (RULES_DIR / "megatron_1d.yaml").read_text()
    path.write_text(text.replace("  - [mlp, mp]\n", "  - [mlp, [dp, mp]]\n  - [mlp, mp]\n"))
    run_setup.setup(small_config(rules=str(path), mesh="dp=2,mp=4"))
    err = capsys.readouterr().err
    assert err.startswith(
        f"warning: {path}: params/layers/mlp/down splits mlp over [dp, mp] but the activations over [mp]: "
        "give [mlp, [mp, dp]], the activations' axes first,"
    )
    assert err.count("\n") == 1  # once for the logical axis, not once per weight
    run_setup.setup(small_config(rules=str(path), mesh="dp=1,mp=8"))  # a dp of one device splits nothing
    assert capsys.readouterr().err == ""
    path.write_text(text.replace("  - [mlp, mp]\n", "  - [mlp, [mp, dp]]\n  - [mlp, mp]\n"))
    run_setup.setup(small_config(rules=str(path), mesh="dp=2,mp=4"))
    assert capsys.readouterr().err == ""


def test_mesh_of_wrong_size_is_an_error():
    with pytest.raises(UserError, match=r"mesh 'dp=2,mp=2' has 4 devices but 8 are available"):
        run_setup.setup(small_config(mesh="dp=2,mp=2"))


def test_mesh_axes_must_match_the_rule_file():
    with pytest.raises(UserError, match=r"names axes \['data', 'mp'\] but the rule file's mesh_axes"):
        make_mesh("data=2,mp=4", load_rules("dp").mesh_axes)
    with pytest.raises(
        UserError,
        match=r"but .*rules/dp.yaml's mesh_axes are \['dp', 'mp'\] \(no size for axis 'dp'\); give "
        r"--config.mesh in those axes \(dp=N,mp=N\)$",
    ):
        run_setup.setup(small_config(rules="dp", mesh="data=2,mp=4"))


@pytest.mark.parametrize(
    "rules, mesh, why",
    [
        ("data_fsdp_tensor", "dp=2,mp=4", "no size for axis 'data'"),
        ("megatron_1d", "data=2,fsdp=2,tensor=2", "no size for axis 'dp'"),
        ("data_fsdp_tensor", "data=2,fsdp=2,tensor=1,mp=2", "axis 'mp' is not one of them"),
    ],
)
def test_a_mesh_of_other_axes_than_the_rule_file_names_one_axis(rules, mesh, why):
    """A three-axis rule file given a two-axis mesh, or the other way round: one line, before compiling."""
    with pytest.raises(UserError, match=rf"mesh_axes are \[.*\] \({why}\); give --config.mesh") as e:
        run_setup.setup(small_config(rules=rules, mesh=mesh))
    assert "\n" not in str(e.value)


def test_a_directory_given_as_a_rule_file_says_so(tmp_path):
    with pytest.raises(UserError, match=r"rule file '.*' is a directory; name a \.yaml file in it"):
        load_rules(str(tmp_path))


@pytest.mark.parametrize("given", ["", " "])
def test_an_empty_rule_file_name_says_so(given):
    with pytest.raises(UserError, match=r"^config.rules is empty: name a rule file \(dp, fsdp"):
        load_rules(given)


def test_unknown_rule_file_lists_the_shipped_ones():
    with pytest.raises(UserError, match=r"rule file 'megatron_3d' not found .*megatron_1d"):
        load_rules("megatron_3d")


def test_a_batch_whose_axis_a_length_rule_took_is_still_checked(tmp_path):
    """Where length rules come first on the batch's mesh axis, the activations validate checks
    leave the batch unsharded, but the token batch is placed by its batch rule alone."""
    path = tmp_path / "length_first.yaml"
    path.write_text(GOOD.replace("rules:\n", "rules:\n  - [length, dp]\n  - [norm_length, dp]\n", 1))
    with pytest.raises(
        UserError, match=r"length_first.yaml: the token batch \(config.batch_size=6\) .* dp=4$"
    ):
        run_setup.setup(small_config(rules=str(path), batch_size=6, mesh="dp=4,mp=2"))
