"""Multi-turn flows in the front end and the IR: fc.Environment, generate(env=, max_turns=), the
trajectory type and its fields, the errors a user meets, and the graph's text and JSON forms."""

from __future__ import annotations

import textwrap

import pytest
from helpers import EXAMPLES

from flowc.errors import SignatureError, ValueUseError, VerificationError
from flowc.ir.serialize import from_json, to_json
from flowc.ir.text import format_graph as to_text
from flowc.ir.verify import verify
from flowc.loader import load_flow


def _flow(tmp_path, body: str, params: str = "calc: fc.Environment"):
    f = tmp_path / "f.py"
    f.write_text(
        "import flowc as fc\n\n@fc.flow\n"
        f"def f(prompts: fc.Prompts, actor: fc.Policy, {params + ', ' if params else ''}*, n: int = 2):\n"
        + textwrap.indent(textwrap.dedent(body), "    ")
    )
    return load_flow(str(f))


def test_the_tool_flow_traces_to_a_trajectory_with_its_environment():
    g = load_flow(str(EXAMPLES / "grpo_tool.py")).trace()
    gen = g["actor.generate"]
    assert gen.kwargs["env"] == "calc" and gen.kwargs["max_turns"] == 3
    assert g.roles["calc"].kind == "environment"
    assert {"env_mask", "env_reward", "turns"} <= set(gen.type.fields)
    text = to_text(g)
    assert "Trajectory[B*n] = generate[actor](%prompts, n=8, env='calc', max_turns=3)" in text
    assert "calc: environment" in text
    assert "%actor.generate.env_reward" in text
    back = from_json(to_json(g))  # the JSON form keeps the environment and the trajectory's fields
    assert back["actor.generate"].kwargs == gen.kwargs and back["actor.generate"].type == gen.type
    verify(back)


def test_env_must_be_an_environment_role(tmp_path):
    fl = _flow(
        tmp_path,
        "r = actor.generate(prompts, env=3)\nactor.update(r, advantages=fc.ops.masked_mean(r.logprobs, r.response_mask, dim=-1))\n",
        "calc: fc.Environment",
    )
    with pytest.raises(SignatureError, match="env must be an environment role"):
        fl.trace()


def test_max_turns_needs_an_environment_and_a_positive_integer(tmp_path):
    fl = _flow(
        tmp_path,
        "r = actor.generate(prompts, max_turns=2)\nactor.update(r, advantages=fc.ops.masked_mean(r.logprobs, r.response_mask, dim=-1))\n",
        "",
    )
    with pytest.raises(SignatureError, match="without env="):
        fl.trace()
    fl = _flow(
        tmp_path,
        "r = actor.generate(prompts, env=calc, max_turns=0)\nactor.update(r, advantages=fc.ops.masked_mean(r.logprobs, r.response_mask, dim=-1))\n",
    )
    with pytest.raises(SignatureError, match="max_turns must be a positive integer"):
        fl.trace()


def test_an_unused_environment_says_to_pass_it_to_generate(tmp_path):
    fl = _flow(
        tmp_path,
        "r = actor.generate(prompts)\nactor.update(r, advantages=fc.ops.masked_mean(r.logprobs, r.response_mask, dim=-1))\n",
    )
    with pytest.raises(SignatureError) as e:
        fl.trace()
    assert "env=calc" in e.value.fix


def test_agent_fields_exist_only_on_trajectories(tmp_path):
    fl = _flow(
        tmp_path,
        "r = actor.generate(prompts)\nactor.update(r, advantages=fc.ops.masked_mean(r.env_reward, r.response_mask))\n",
        "",
    )
    with pytest.raises(ValueUseError, match="only on multi-turn rollouts"):
        fl.trace()


def test_the_verifier_checks_a_graph_that_names_a_missing_environment():
    g = load_flow(str(EXAMPLES / "grpo_tool.py")).trace()
    d = to_json(g).replace('"env": "calc"', '"env": "nope"')
    with pytest.raises(VerificationError, match="'nope' is not an environment role"):
        verify(from_json(d))


def _plan(workload: str):
    from flowc.ir.cluster import ClusterSpec
    from flowc.ir.workload import WorkloadSpec
    from flowc.passes.pipeline import make_plan
    from flowc.planning import resolve_models

    g = load_flow(str(EXAMPLES / "grpo_tool.py")).trace()
    models, _ = resolve_models(g, {"actor": "qwen2.5-7b"})
    return make_plan(g, models, ClusterSpec.parse("1x8xH100"), WorkloadSpec.parse(workload))[0]


BASE = "prompts=256,prompt_len=512,response_len=4096,mean_response_len=1024"


def test_the_planner_prices_turns_observations_and_the_environment():
    one = _plan(BASE + ",turns=1")
    three = _plan(BASE + ",turns=3,obs_len=256")
    slow = _plan(BASE + ",turns=3,obs_len=256,env_latency_s=2")
    t = [p.roles["actor"].phases["generate"].time_s for p in (one, three, slow)]
    assert t[0] < t[1] < t[2]
    # a chain of three 2-second environment steps is on the critical path
    assert t[2] - t[1] >= 3 * 2 - 1e-6
    gen = slow.roles["actor"].phases["generate"]
    assert gen.env_workers > 1 and one.roles["actor"].phases["generate"].env_workers == 0  # no latency: no opinion
    line = next(x for x in slow.why if x.startswith("Multi-turn"))
    assert (
        "3 policy turns per trajectory" in line
        and "3 steps of 2 s" in line
        and f"{gen.env_workers} environment processes" in line
    )


def test_the_environment_pool_is_sized_to_keep_up_with_the_engine():
    from flowc.passes.flops import Demand
    from flowc.passes.generation_costs import env_workers_for

    d = Demand(100, 8, 20, 10.0, turns=2.0, env_latency_s=0.5)
    assert env_workers_for(d, 100, gen_s=10.0) == 10  # 100 s of environment work over 10 s of generation
    assert env_workers_for(d, 100, gen_s=1000.0) == 1
    assert env_workers_for(d, 4, gen_s=0.1) == 4  # never more than one per trajectory
    assert env_workers_for(Demand(100, 8, 20, 10.0, turns=2.0), 100, gen_s=1.0) == 0  # no latency given: the config's


def test_a_run_checks_its_environment_before_the_first_step(tmp_path):
    """A class whose reset fails, or whose stop string is not one token, is refused when the run is
    prepared — not discovered as every trajectory of every step failing."""
    from flowc.envs import check_envs
    from flowc.errors import SpecError
    from flowc.runtime.envs import bind_class
    from flowc.tasks.calculator import Calculator, asset_dir

    class Broken(Calculator):
        def reset(self, record):
            return record["missing"]

    class LongStop(Calculator):
        stop = ("*)",)

    rows = [{"prompt": "12*34=", "answer": "408"}]
    tok = str(asset_dir())
    check_envs({"calc": bind_class("calc", Calculator, "C", workers=1, timeout_s=5, error_reward=0)}, rows, "prompt", tok)
    with pytest.raises(SpecError, match="failed to reset from the first data row: error: KeyError: 'missing'"):
        check_envs({"calc": bind_class("calc", Broken, "B", workers=1, timeout_s=5, error_reward=0)}, rows, "prompt", tok)
    with pytest.raises(SpecError, match=r"stop string '\*\)' is 2 tokens"):
        check_envs({"calc": bind_class("calc", LongStop, "L", workers=1, timeout_s=5, error_reward=0)}, rows, "prompt", tok)


def test_multi_turn_generation_is_planned_on_single_device_replicas():
    """A replica of several ranks would run each rank's own environments: the planner plans tp 1
    and pp 1 for a multi-turn generate, and a policy too large for one device is refused saying so."""
    from flowc.errors import InfeasibleError
    from flowc.ir.cluster import ClusterSpec
    from flowc.ir.workload import WorkloadSpec
    from flowc.passes.pipeline import make_plan
    from flowc.planning import resolve_models

    gen = _plan(BASE + ",turns=3").roles["actor"].phases["generate"]
    assert (gen.tp, gen.pp) == (1, 1)
    g = load_flow(str(EXAMPLES / "grpo_tool.py")).trace()
    models, _ = resolve_models(g, {"actor": "llama-3.1-70b"})
    with pytest.raises(InfeasibleError) as e:
        make_plan(g, models, ClusterSpec.parse("2x8xH100"), WorkloadSpec.parse("prompts=64,prompt_len=512,response_len=2048"))
    assert "runs on single-device replicas" in e.value.what and "141.1 GB of a device's 76.0 GB" in e.value.what
    assert "fit one device, or a device type with more memory" in e.value.fix
