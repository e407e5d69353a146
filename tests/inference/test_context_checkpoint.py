"""evaluate and generate from a checkpoint trained under context parallelism (context_dp,
data=2,context=4): under the layout it was saved with (the decoding cache split by length over
context; a prompt of 5 and 6 new tokens, which 4 does not divide) and under plain data
parallelism, the same loss and the same greedy tokens."""

import json

import pytest
from conftest import small_config

from gspmd_tp.inference import evaluate, generate
from gspmd_tp.train import loop


def test_evaluate_and_generate_read_a_context_parallel_run_under_either_layout(tmp_path, capsys):
    workdir = str(tmp_path / "run")
    loop.train(small_config(rules="context_dp", mesh="data=2,context=4"), workdir)
    capsys.readouterr()
    layouts = {"saved": [], "dp": ["--config.rules=dp", "--config.mesh=dp=8,mp=1"]}
    said = {}
    for name, flags in layouts.items():
        assert evaluate.main(["--workdir", workdir, "--json", *flags]) == 0
        evaluated = json.loads(capsys.readouterr().out)
        assert (
            generate.main(
                ["--workdir", workdir, "--prompt=hello", "--max_new_tokens=6", "--temperature=0", *flags]
            )
            == 0
        )
        said[name] = evaluated, capsys.readouterr().out
    (eval_cp, gen_cp), (eval_dp, gen_dp) = said["saved"], said["dp"]
    assert eval_cp["mesh"] == "data=2,context=4" and eval_dp["mesh"] == "dp=8,mp=1"
    assert eval_cp["step"] == eval_dp["step"] == 4
    assert eval_cp["loss"] == pytest.approx(eval_dp["loss"], rel=1e-5)
    assert gen_cp == gen_dp and gen_cp.rstrip("\n").splitlines()[-1].startswith("hello")
