"""Issue 31: adversarial trials on the newest surface (drafter variants, export, eval, config,
tool-call prepare). One test per defect found, each failing on the code before its fix; the
rules they enforce are listed in docs/reliability.md."""

from __future__ import annotations

import pytest

from conftest import make_drafter, tiny_qwen3
from flashdraft.cli import main
from flashdraft.evaluate import write_prompts
from flashdraft.target import TargetModel


@pytest.fixture(scope="module")
def eval_dir(tmp_path_factory):
    """A 4-layer target, a block-4 drafter of it, and two prompts."""
    d = tmp_path_factory.mktemp("issue31")
    model = tiny_qwen3(num_layers=4, seed=1)
    model.save_pretrained(d / "target")
    make_drafter(TargetModel(model, [1, 2]), num_layers=1, block_size=4).save_pretrained(d / "drafter")
    write_prompts(d / "prompts.jsonl", [[1, 2, 3, 4], [5, 6, 7]])
    return d


def _eval(d, *extra, drafter=True):
    return main(["eval", "--target", str(d / "target"), "--prompts", str(d / "prompts.jsonl"), "--device", "cpu",
                 *(["--drafter", str(d / "drafter")] if drafter else ["--baseline", "ngram"]), *extra])


# ---- 2: eval --output never overwrites the command's own inputs ------------------------------

@pytest.mark.parametrize("victim", ["prompts.jsonl", "target/config.json", "drafter/model.safetensors", "target"])
def test_eval_output_never_overwrites_its_own_inputs(eval_dir, victim):
    path = eval_dir / victim
    before = sorted(p.read_bytes() for p in ([path] if path.is_file() else path.iterdir()))
    with pytest.raises(ValueError, match=rf"--output .*{victim} (is|lies inside|holds) .*an input of this command"):
        _eval(eval_dir, "--output", str(path), "--max-new-tokens", "4")
    assert sorted(p.read_bytes() for p in ([path] if path.is_file() else path.iterdir())) == before


# ---- 3: a tiny positive temperature is refused where it is given, not mid-run ---------------

def test_a_temperature_below_the_minimum_is_refused_at_load_and_parse_and_the_minimum_decodes(eval_dir):
    from flashdraft.config import load_config
    from flashdraft.speculative import MIN_TEMPERATURE

    with pytest.raises(ValueError, match=r"train.eval_temperature=1e-40 is invalid: use 0 \(greedy\) or a "
                                         r"temperature of at least 0.0001"):
        load_config(overrides=["train.eval_temperature=1e-40"])
    with pytest.raises(ValueError, match=r"--temperature 1e-40: use 0 \(greedy\) or a finite temperature of at least"):
        _eval(eval_dir, "--temperature", "1e-40", "--max-new-tokens", "4")
    assert _eval(eval_dir, "--temperature", str(MIN_TEMPERATURE), "--max-new-tokens", "6") == 0
