"""The engines' capability declarations and the one start-up check of a config against them
(grpokit/rollout/engines.py): its errors, and the generated table in docs/rollout.md."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from grpokit.config import ConfigError, load_config
from grpokit.rollout import RolloutEngine
from grpokit.rollout.engines import ENGINES, capability_table, check_engine

DOCS = Path(__file__).resolve().parents[1] / "docs" / "rollout.md"


def test_the_docs_table_is_the_generated_one():
    text = DOCS.read_text()
    found = re.search(r"do not edit by hand -->\n(.*?)<!-- end of engine capabilities -->", text, re.S)
    assert found, "docs/rollout.md has no generated engine table"
    assert found.group(1) == capability_table(), (
        "regenerate it from grpokit.rollout.engines.capability_table()"
    )


def test_every_engine_declares_its_capabilities_and_the_whole_interface():
    for spec in ENGINES:
        cls = spec.load()
        assert cls.caps is not RolloutEngine.caps, f"{cls.__name__} declares no caps"
        for method in ("generate", "sync_weights", "close", "sleep", "wake_up"):
            assert callable(getattr(cls, method, None)), (cls.__name__, method)


@pytest.mark.parametrize(
    "overrides, world_size, message",
    [
        (["rollout.max_policy_lag=1"], 1, "rollout.max_policy_lag=1 needs the sampler's log-probs"),
        (["rollout.importance_correction=token_mask"], 1, "use rollout.engine=fast or vllm"),
        (
            ["rollout.engine=vllm", "model.lora.r=4"],
            1,
            "model.lora does not work with rollout.engine=vllm yet",
        ),
        (["rollout.engine=vllm"], 2, "rollout.engine=vllm takes one trainer process; under torchrun use"),
        (
            ["rollout.engine=fast", "rollout.vllm_mode=server"],
            1,
            "rollout.vllm_mode=server samples from a vLLM",
        ),
        (["rollout.async_sampler=process"], 1, "rollout.async_sampler=process runs the fast engine"),
    ],
)
def test_a_feature_the_engine_lacks_is_one_line_naming_the_engines_that_have_it(
    overrides, world_size, message
):
    with pytest.raises(ConfigError, match=re.escape(message)) as err:
        check_engine(load_config(None, overrides), world_size)
    assert "\n" not in str(err.value)


def test_what_the_engines_can_run_passes():
    for overrides in (
        ["rollout.engine=fast", "rollout.max_policy_lag=1", "rollout.async_sampler=process"],
        ["rollout.engine=vllm", "rollout.vllm_mode=server", "rollout.importance_correction=token_mask"],
        ["rollout.engine=hf", "model.lora.r=4"],
    ):
        assert check_engine(load_config(None, overrides)).name == overrides[0].split("=")[1]
