"""`flowc run`'s options (and `flowc plan`'s that preview a run) as a :class:`~flowc.run.RunRequest`:
the command line's words over the config file's front keys, and a resume's recorded options."""

from __future__ import annotations

from pathlib import Path

from flowc.errors import FlowcError


def run_request(
    file: str | None,
    overrides: list[str] | None,
    *,
    model: list[str] | None,
    data: str | None,
    eval_data: str | None,
    reward: list[str] | None,
    env: list[str] | None,
    cluster: str,
    device: str | None,
    plan_file: str | None,
    workload: str | None,
    steps: int | None,
    out: str | None,
    resume: str | None,
    override: bool,
    rollout: str | None,
    pin: list[str] | None,
    config: str | None,
    sets: list[str] | None,
    report_to: str | None,
):
    """The :class:`~flowc.run.RunRequest` of `flowc run`'s options (a resume's from its run.json)."""
    from flowc.ir.run_config import RunConfig
    from flowc.loader import load_flow
    from flowc.run import RunRequest, given_options, resume_request

    if file is None and resume is None:
        raise FlowcError("flowc run needs a flow file", fix="flowc run FILE [NAME=VALUE]… (or --resume RUN_DIR)")
    if override and resume is None:
        raise FlowcError("--override changes a resumed run's options; there is no --resume", fix="drop --override")
    sets = [*(sets or []), *([f"report_to={trackers_list(report_to)}"] if report_to is not None else [])]
    if resume is not None and sets and not config and (Path(resume) / "run.json").exists():
        from flowc.run_record import RunRecord

        # --set on a resume changes the recorded settings, it does not replace them
        cfg, front = RunRecord.read(Path(resume)).run_config_with(sets)
    else:
        cfg, front = RunConfig.load(config, sets)
    fl = load_flow(file) if file is not None else None
    if fl is None and overrides:
        raise FlowcError(
            "hyperparameter overrides need the flow file", fix="flowc run FILE NAME=VALUE… --resume RUN_DIR --override"
        )
    hyper = {**front.get("hyperparams", {}), **(fl.parse_overrides(overrides or []) if fl is not None else {})}
    models = {**front.get("model", {}), **role_pairs(model, "--model")}
    rewards = {**front.get("reward", {}), **role_pairs(reward, "--reward")}
    envs = {**front.get("env", {}), **role_pairs(env, "--env")}
    given = dict(
        overrides=hyper,
        models=models,
        data=data or front.get("data"),
        eval_data=eval_data or front.get("eval_data"),
        rewards=rewards,
        envs=envs,
        cluster=front.get("cluster", cluster) if cluster == "local" else cluster,
        device=device or front.get("device"),
        workload=workload or front.get("workload"),
        steps=steps,
        rollout=rollout or front.get("rollout"),
        pins=list(pin or []),
        plan_file=plan_file or front.get("plan"),
    )
    if resume is not None and (Path(resume) / "run.json").exists():
        if out is not None and Path(out).resolve() != Path(resume).resolve():
            raise FlowcError(f"--out {out} with --resume {resume}: a resumed run writes to its own folder", fix="drop --out")
        normal = {**given, "cluster": given["cluster"] if given["cluster"] != "local" else None}
        req = resume_request(resume, given_options(flow=fl, config=cfg if config or sets else None, **normal), override=override)
    else:  # a new run (or, with --override, a folder written before run.json existed)
        if fl is None:
            raise FlowcError(
                f"{resume} has no run.json to read the flow from", fix="give the flow file: flowc run FILE … --resume"
            )
        req = RunRequest(flow=fl, out=out or front.get("out"), resume=resume, config=cfg, **given)  # type: ignore[arg-type]
        if resume is not None and not override:
            raise FlowcError(
                f"{resume} has no run.json: flowc cannot tell which options the run used",
                fix=f"give them all again and add --override: flowc run FILE … --resume {resume} --override",
            )
    return req


def trackers_list(words: str) -> str:
    """``--report-to a,b`` as the YAML list ``report_to`` takes (``none``: [])."""
    names = [w.strip() for w in words.split(",") if w.strip() and w.strip() != "none"]
    return "[" + ", ".join(names) + "]"


def role_pairs(words: list[str] | None, flag: str) -> dict[str, str]:
    """``ROLE=VALUE`` words of a repeated option (``--model``, ``--reward``, ``--env``) as a mapping."""
    out: dict[str, str] = {}
    for w in words or []:
        if "=" not in w:
            raise FlowcError(f"{flag} {w!r} is not ROLE=VALUE", fix=f"e.g. {flag} actor=...")
        k, v = w.split("=", 1)
        out[k.strip()] = v.strip()
    return out
