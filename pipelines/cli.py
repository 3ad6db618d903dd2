"""`ctr-pipeline`: the command line of the CTR pipeline (`ctr`, its former name, is an alias for one release).

    ctr-pipeline generate             write a synthetic click log (minute partitions)
    ctr-pipeline generate --events    write impression and click streams instead (joined by the pipeline)
    ctr-pipeline ingest --spec avazu FILE...   write a team's own files as raw minute partitions of a feature spec
    ctr-pipeline datasets fetch movielens  a real public log (movielens, obd) from the package index, as a CSV to ingest
    ctr-pipeline run daily --date 2026-01-01   run the daily pipeline without Airflow
    ctr-pipeline run incremental --minute 2026-01-02T00:05   one minute run: delta on the newest model, gated, published
    ctr-pipeline trigger incremental [--minute T]   trigger the ctr_incremental DAG through the Airflow REST API
    ctr-pipeline trigger daily [--minute T]   trigger ctr_daily for the UTC day ending at T (default: yesterday)
    ctr-pipeline rollback VERSION     retract every newer version: serving and minute runs go back to VERSION
    ctr-pipeline promote [VERSION]    label VERSION (default: the newest) `stable`; newer ones are `canary`
    ctr-pipeline serve                serve the newest published model (TF Serving's REST and gRPC APIs)
    ctr-pipeline spark-connect        a Spark Connect server for SPARK_REMOTE=sc://127.0.0.1:15002
    ctr-pipeline airflow dags list    the Airflow CLI on the project's embedded settings
    ctr-pipeline ui airflow | ctr-pipeline ui mlflow   open the Airflow UI / the MLflow UI on this data
    ctr-pipeline tracking status | flush   tracking kept while the MLflow server was away; deliver it now
    ctr-pipeline stack up | down | status | logs | env   the production topology as processes on this machine
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import subprocess
import sys
import uuid
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from components.config import ConfigError, PipelineConfig, load_config, parse_override_args
from components.errors import DataValidationError
from components.model_store import ModelStoreError
from components.stopping import call_in_foreground
from pipelines.stack import StackError
from pipelines.trigger import TriggerError

# The console script (pyproject.toml); `ctr`, its former name, is an alias that prints a notice (deprecated_main).
PROG = "ctr-pipeline"


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    for noisy in ("py4j", "great_expectations", "urllib3", "alembic", "matplotlib", "absl", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def config_from_args(args: argparse.Namespace, extra: dict | None = None) -> PipelineConfig:
    overrides = {"features.spec": args.spec} if getattr(args, "spec", None) else {}
    overrides.update(parse_override_args(args.set or []))
    overrides.update(extra or {})
    return load_config(overrides=overrides, yaml_path=args.config)


def cmd_generate(args: argparse.Namespace) -> int:
    from components.feature_spec import spec_for
    from components.layout import Layout
    from components.synthetic import RawShape, generate

    extra = {f"generate.{k}": v for k, v in (("minutes", args.minutes), ("rows_per_minute", args.rows_per_minute),
                                              ("start", args.start), ("seed", args.seed)) if v is not None}
    config = config_from_args(args, extra)
    # The click log's columns, from the spec (refused here, before anything is written, if it has list columns);
    # the event streams have their own (components.events).
    shape = None if args.events else RawShape.of(spec_for(config))

    def progress(done: int, total: int) -> None:
        if done == total or done % max(1, total // 10) == 0:
            print(f"  generated {done}/{total} minutes", flush=True)

    if args.live:
        from components.live_traffic import write_live_minutes

        if args.events:
            raise ConfigError("--live writes the labelled click log; drop --events (event streams have no live mode)")
        if args.start:
            raise ConfigError(f"--live writes the minutes of the wall clock, so --start {args.start} does not apply; "
                              "drop --start")
        num_minutes = config.generate.minutes
        if num_minutes < 1:
            raise ConfigError(f"--live needs --minutes of at least 1, got {num_minutes}")
        layout = Layout(config.paths.root)
        print(f"writing {num_minutes} live minutes of {config.generate.rows_per_minute} rows to {layout.root}, "
              "each right after it closes", flush=True)

        def report(minute, seconds_after_close: float) -> None:
            print(f"  wrote minute {minute:%Y-%m-%dT%H:%M}Z, {seconds_after_close:.1f} s after it closed",
                  flush=True)

        write_live_minutes(config.generate, layout, num_minutes=num_minutes, on_minute=report, shape=shape)
        return 0

    if args.events:
        from components.events import generate_events

        summary = generate_events(config.generate, config.events, Layout(config.paths.root), progress=progress)
        print(json.dumps(summary, indent=2))
        print("impression and click streams written; run the daily pipeline on them with "
              "--set features.source=events")
        return 0
    summary = generate(config.generate, Layout(config.paths.root), progress=progress, shape=shape)
    print(json.dumps(summary, indent=2))
    print(f"planted model AUC (best achievable): {summary['planted_auc']:.4f}")
    start, end = (datetime.fromisoformat(summary[key]).strftime("%Y-%m-%dT%H:%M") for key in ("start", "end"))
    print(f"next: {next_daily_command(args, start, end)}")
    return 0


def cmd_ingest(args: argparse.Namespace) -> int:
    from components.feature_spec import spec_for
    from components.ingest import ingest
    from components.layout import Layout

    config = config_from_args(args)
    if args.stream:
        return ingest_stream(args, config)
    report = _ingested(lambda: ingest(spec_for(config), args.files, Layout(config.paths.root), start=args.start,
                                      rows_per_minute=args.rows_per_minute, input_format=args.format,
                                      progress=_progress, s3_endpoint_url=config.paths.s3_endpoint_url),
                       "rows", config.paths.root / "raw", "malformed lines")
    if report is None:
        return 2
    print(f"next: {next_daily_command(args, report.first_minute, report.end_minute)}")
    return 0


def ingest_stream(args: argparse.Namespace, config: PipelineConfig) -> int:
    """`ingest --stream`: the files as an event stream (components.event_ingest)."""
    from components.event_ingest import ingest_events
    from components.events import CLICKS, IMPRESSIONS, final_until, stream_span, stream_watermark
    from components.feature_spec import spec_for
    from components.layout import Layout

    if args.start or args.rows_per_minute:
        print(f"{PROG} ingest: --start and --rows-per-minute place rows of a click log without a timestamp; an "
              "event stream's rows are placed by their ts: drop them", file=sys.stderr)
        return 2
    layout = Layout(config.paths.root)
    if _ingested(lambda: ingest_events(spec_for(config), args.stream, args.files, layout, input_format=args.format,
                                       progress=_progress, s3_endpoint_url=config.paths.s3_endpoint_url),
                 args.stream, layout.raw_events_dir(args.stream), "rows without a key") is None:
        return 2
    impressions, clicks = stream_span(layout, IMPRESSIONS), stream_watermark(layout, CLICKS)
    window = config.events.attribution_window_s
    if impressions is None or clicks is None:
        print(f"next: ingest the {'clicks' if clicks is None else 'impressions'} "
              f"(--stream {'clicks' if clicks is None else 'impressions'})")
        return 0
    end = min(impressions[1], final_until(clicks, window))
    if end <= impressions[0]:
        print(f"no impression minute has final labels yet: the clicks end at {clicks:%Y-%m-%dT%H:%M}, and a "
              f"minute's labels are final {window} s (events.attribution_window_s) after it ends; ingest later "
              "clicks")
        return 0
    command = next_daily_command(args, f"{impressions[0]:%Y-%m-%dT%H:%M}", f"{end:%Y-%m-%dT%H:%M}")
    print(f"next (the minutes whose clicks are in, {window} s after each): {command}"
          + ("" if config.features.source == "events" else " --set features.source=events"))
    return 0


def _progress(message: str) -> None:
    print(f"  {message}", flush=True)


def _ingested(run: Callable[[], Any], rows: str, where: Path, rejected: str) -> Any:
    """`run()` (an ingest: its IngestReport), its report printed as JSON and in a line; None after printing the
    error when the input or the spec is refused."""
    from components.feature_spec import FeatureSpecError
    from components.ingest import IngestError

    try:
        report = run()
    except (IngestError, FeatureSpecError) as err:
        print(f"{PROG} ingest: {err}", file=sys.stderr)
        return None
    print(json.dumps(report.as_dict(), indent=2))
    print(f"{report.rows_written} {rows} in {report.minutes_written + report.minutes_unchanged} minutes "
          f"[{report.first_minute}, {report.end_minute}) under {where}"
          + (f"; {report.rejected} {rejected} kept in {report.rejects_file}" if report.rejected else ""))
    return report


def next_daily_command(args: argparse.Namespace, start: str, end: str) -> str:
    """The daily run over what `ingest` or `generate` wrote, with the --config, --spec and every --set it was
    given: it runs as printed."""
    words = [PROG, "run", "daily"]
    if args.config:
        words += ["--config", str(args.config)]
    if args.spec:
        words += ["--spec", args.spec]
    for override in args.set or []:
        words += ["--set", override]
    return shlex.join([*words, "--start", start, "--end", end])


def cmd_datasets(args: argparse.Namespace) -> int:
    from components.datasets import DatasetError, fetch_dataset

    config = config_from_args(args)
    out = args.out or str(config.paths.root / "datasets")
    try:
        report = fetch_dataset(args.name, out, cache_dir=args.cache or os.path.join(out, "wheels"),
                               policy=args.policy, campaign=args.campaign)
    except DatasetError as err:
        print(f"{PROG} datasets: {err}", file=sys.stderr)
        return 2
    print(json.dumps(report.as_dict(), indent=2))
    given = [arg for flag, value in (("--config", args.config),) if value for arg in (flag, value)]
    given += [arg for value in args.set or [] for arg in ("--set", value)]
    print("next: " + shlex.join([PROG, "ingest", "--spec", args.name, *given, report.path]))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from components.interval import Interval
    from pipelines.context import RunContext
    from pipelines.runner import run_steps, select_steps

    config = config_from_args(args)
    if args.minute:
        interval = Interval.minute(args.minute)
    elif args.date:
        interval = Interval.day(args.date)
    elif args.start and args.end:
        interval = Interval.parse(args.start, args.end)
    else:
        raise ConfigError("give --date YYYY-MM-DD or both --start and --end (ISO times, UTC)")
    steps = select_steps(args.pipeline, args.steps.split(",") if args.steps else None)
    ctx = RunContext(config=config, interval=interval, pipeline=args.pipeline,
                     run_id=args.run_id or f"cli__{interval.tag}__{uuid.uuid4().hex[:8]}")
    from pipelines.incremental import NothingToLearn

    try:
        outputs = run_steps(ctx, steps)
    except NothingToLearn as err:
        print(f"nothing to do: {err}")
        return 0
    print(json.dumps(outputs, indent=2, default=str))
    report = outputs.get("evaluate") if isinstance(outputs, dict) else None
    if isinstance(report, dict) and report.get("baseline"):
        from pipelines.daily import baseline_line

        metrics = report["metrics"]
        print(baseline_line(metrics["auc"], metrics["logloss"], report["baseline"]))
    return 0


def cmd_trigger(args: argparse.Namespace) -> int:
    from pipelines.trigger import default_api_url, trigger_dag, trigger_interval

    config = config_from_args(args)
    run = trigger_dag(config, f"ctr_{args.pipeline}", api_url=args.api_url or default_api_url(),
                      interval=trigger_interval(args.pipeline, args.minute),
                      overrides=parse_override_args(args.param or []), unpause=args.unpause)
    print(f"triggered {run['dag_id']} run {run['dag_run_id']} (data interval {run.get('data_interval_start')} - "
          f"{run.get('data_interval_end')}); state: {run.get('state')}")
    return 0


def cmd_rollback(args: argparse.Namespace) -> int:
    from components.model_store import open_model_store, rollback
    from components.registry import follow_stable
    from pipelines.daily import MODEL_NAME

    config = config_from_args(args)
    store = open_model_store(config.paths.model_store_uri, config.paths.s3_endpoint_url)
    retracted = rollback(store, MODEL_NAME, args.version, args.reason)
    print(f"retracted {len(retracted)} newer version(s) {retracted}; serving moves back to {args.version} at its next "
          f"poll and minute runs train on from it; labels now {store.labels(MODEL_NAME)}")
    print(follow_stable(config, store.stable(MODEL_NAME)))
    return 0


def cmd_promote(args: argparse.Namespace) -> int:
    from components.model_store import STABLE_LABEL, open_model_store, promote
    from components.registry import follow_stable
    from pipelines.daily import MODEL_NAME

    config = config_from_args(args)
    store = open_model_store(config.paths.model_store_uri, config.paths.s3_endpoint_url)
    version = promote(store, MODEL_NAME, args.version, args.reason)
    labels = store.labels(MODEL_NAME)
    print(f"promoted version {version}; labels now {labels}. Serving answers /labels/{STABLE_LABEL} (gRPC "
          f"version_label {STABLE_LABEL!r}) from {labels.get(STABLE_LABEL)} at its next poll")
    print(follow_stable(config, store.stable(MODEL_NAME)))
    return 0


def cmd_tables(args: argparse.Namespace) -> int:
    from components.model_store import open_model_store
    from components.table_report import format_report
    from pipelines.daily import MODEL_NAME

    config = config_from_args(args)
    store = open_model_store(config.paths.model_store_uri, config.paths.s3_endpoint_url)
    versions = store.versions(MODEL_NAME)
    version = args.version or store.latest(MODEL_NAME)
    if version is None or version not in versions:
        print(f"no version {version!r} in the model store {config.paths.model_store_uri}; its versions: "
              f"{', '.join(versions[-10:]) or 'none yet (run ctr-pipeline run daily first)'}", file=sys.stderr)
        return 2
    report = store.manifest(MODEL_NAME, version).get("tables")
    if report is None:
        print(f"version {version} has no table report: it was published before runs made one; the next daily or "
              "minute run's version has it", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=1) if args.json else format_report(report))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from serving.server import serve

    extra: dict[str, object] = {"serving.port": args.port} if args.port else {}
    if args.grpc_port is not None:
        extra["serving.grpc_port"] = args.grpc_port
    if args.host:
        extra["serving.host"] = args.host
    serve(config_from_args(args, extra))
    return 0


def cmd_tracking(args: argparse.Namespace) -> int:
    """What waits in the tracking outbox, and (flush) delivering it now rather than at the next run."""
    from components.tracking import deliver_outbox, outbox_dir, server_answers
    from components.tracking_outbox import Outbox
    from pipelines.context import log_served_model

    config = config_from_args(args)
    outbox = Outbox(outbox_dir(config))
    runs, calls = outbox.count()
    print(f"{calls} call(s) of {runs} run(s) wait in {outbox.directory} for {config.tracking_uri}")
    if args.action == "status" or not runs:
        return 0
    if not server_answers(config.tracking_uri, config.tracking.probe_timeout_s):
        print(f"ctr: tracking: nothing answers at {config.tracking_uri}; they stay where they are, and the next "
              "run that reaches it delivers them", file=sys.stderr)
        return 1
    delivery = deliver_outbox(config, model_logger=log_served_model)
    print(f"delivered {delivery.calls} call(s); {delivery.runs} run(s) complete, {delivery.pending_runs} still "
          "waiting")
    return 0 if delivery.pending_runs == 0 else 1


def cmd_spark_connect(args: argparse.Namespace) -> int:
    """A Spark Connect server in the foreground, for SPARK_REMOTE: per-minute jobs skip Spark's start-up. SIGTERM,
    SIGINT and SIGHUP stop its JVM, then the command (status 0)."""
    from spark_jobs.connect import DEFAULT_PORT, run_in_foreground

    config = config_from_args(args)
    return run_in_foreground(config.spark, args.port or DEFAULT_PORT, log_dir=config.paths.root / "logs")


def cmd_worker(args: argparse.Namespace) -> int:
    """The step worker in the foreground: Airflow's minute-run tasks hand it their steps (pipelines/step_worker.py).
    SIGTERM, SIGINT and SIGHUP stop it (status 0)."""
    from components.stopping import StopRequested, stop_on_signals
    from pipelines.step_auth import required_worker_secret
    from pipelines.step_worker import serve

    config = config_from_args(args)
    secret = required_worker_secret(os.environ)
    try:
        with stop_on_signals():
            again = serve(config, args.host, args.port, advertise=args.advertise, secret=secret,
                          ready=lambda address: print(f"ctr: step worker for {config.paths.root} on {address[0]}:"
                                                      f"{address[1]}", flush=True))
    except StopRequested:
        return 0
    if again:  # its memory grew past incremental.step_worker_max_rss_mib: the same command, as a fresh process
        sys.stdout.flush()
        os.execv(sys.executable, [sys.executable, "-m", "pipelines.cli", *sys.argv[1:]])
    return 0


def cmd_airflow(args: argparse.Namespace) -> int:
    from pipelines.airflow_env import airflow_environment

    env = airflow_environment(config_from_args(args))
    return subprocess.call([sys.executable, "-m", "airflow", *args.airflow_args], env=env)


def cmd_ui(args: argparse.Namespace) -> int:
    """The Airflow or MLflow UI in the foreground; a stop signal (Ctrl-C, SIGTERM) stops its server too."""
    from pipelines.airflow_env import airflow_environment

    config = config_from_args(args)
    if args.which == "airflow":
        env = airflow_environment(config, api_port=args.port or 8080)
        print(f"Airflow UI on http://localhost:{args.port or 8080} (admin password: "
              f"{config.paths.root / 'airflow' / 'simple_auth_manager_passwords.json.generated'})", flush=True)
        from pipelines.airflow_env import prepare_database

        prepare_database(env, config.paths.root / "airflow" / "prepare.log")
        return call_in_foreground([sys.executable, "-m", "airflow", "standalone"], env=env)
    port = str(args.port or 5000)
    from components.tracking import UI_TRAINING_VIEW

    print(f"MLflow UI on http://localhost:{port}/{UI_TRAINING_VIEW} ({config.tracking_uri})", flush=True)
    return call_in_foreground([sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", config.tracking_uri,
                               "--host", "127.0.0.1", "--port", port])


def cmd_stack(args: argparse.Namespace) -> int:
    from components.tracking import UI_TRAINING_VIEW
    from pipelines import stack

    settings = stack.load_settings(create_secrets=args.action == "up", require_secrets=args.action == "env")
    if args.action == "up":
        print(f"stack {settings.name}: home {settings.home}, secrets {settings.values['CTR_STACK_SECRETS']}",
              flush=True)
        stack.up(settings, say=lambda line: print(f"  {line}", flush=True))
        print(stack.format_status(stack.status(settings)))
        print(f"Airflow UI {settings.url('AIRFLOW_API_PORT')} (user {settings.secrets['_AIRFLOW_WWW_USER_USERNAME']}), "
              f"MLflow UI {settings.url('MLFLOW_PORT')}/{UI_TRAINING_VIEW} (user "
              f"{settings.secrets['MLFLOW_TRACKING_USERNAME']}); "
              f"passwords in {settings.values['CTR_STACK_SECRETS']}. Use it from a shell: eval \"$(ctr stack env)\"")
    elif args.action == "down":
        stack.down(settings, say=lambda line: print(f"  {line}", flush=True))
        if args.purge:
            stack.drop_postgres(settings)
            import shutil

            shutil.rmtree(settings.home, ignore_errors=True)
            print(f"  purged: databases {settings.name}_airflow, {settings.name}_mlflow and {settings.home}")
    elif args.action == "status":
        rows = stack.status(settings)
        print(stack.format_status(rows))
        return 0 if all(r["state"].startswith(("healthy", "external, up")) for r in rows) else 3
    elif args.action == "env":
        print("\n".join(f"export {k}={shlex.quote(v)}" for k, v in stack.client_environment(settings).items()))
    else:
        return _stack_logs(stack, settings, args)
    return 0


def _stack_logs(stack, settings, args: argparse.Namespace) -> int:
    paths = ([stack.log_path(settings, args.service)] if args.service
             else sorted((settings.home / "logs").glob("*.log")))
    for path in paths:
        if not path.is_file():
            print(f"==> {path} (none yet)")
            continue
        if len(paths) > 1:
            print(f"==> {path.stem} <==")
        print("\n".join(path.read_text(errors="replace").splitlines()[-args.lines:]), flush=True)
    if args.follow:
        return call_in_foreground(["tail", "-n", "0", "-F", *map(str, paths)])
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", help="YAML file of config sections (see components/config.py)")
    common.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override one config value")
    from components.feature_spec import preset_names

    common.add_argument("--spec", help=f"the feature spec: a preset ({', '.join(preset_names())}) or a YAML file "
                                       "(features.spec)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", parents=[common], help="write a synthetic click log",
                       description="Write minute partitions of a synthetic click log in the feature spec's layout "
                                   "(--spec; the criteo preset by default), labels drawn from a planted model whose "
                                   "AUC is printed: the best any model can reach on them.")
    p.add_argument("--minutes", type=int)
    p.add_argument("--rows-per-minute", type=int)
    p.add_argument("--start", help="first minute, ISO time (UTC)")
    p.add_argument("--seed", type=int)
    p.add_argument("--events", action="store_true",
                   help="write impression and click streams (raw/impressions, raw/clicks) instead of a labelled log")
    p.add_argument("--live", action="store_true",
                   help="write --minutes wall-clock minutes, starting with the open one, each right after it closes")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("ingest", parents=[common], help="write files as raw minute partitions of a feature spec")
    p.add_argument("files", nargs="+", metavar="FILE", help="CSV, TSV or Parquet files (gzip, zstd or bz2 "
                                                             "compressed or not), folders, globs or s3://bucket/prefix")
    p.add_argument("--start", help="first minute (ISO, UTC) for specs without a timestamp column")
    p.add_argument("--rows-per-minute", type=int, help="rows a minute for specs without a timestamp (default 1000)")
    p.add_argument("--format", default="auto", choices=["auto", "tsv", "csv", "parquet"],
                   help="the input files' format (auto: .parquet, else tab or comma from the first line)")
    p.add_argument("--stream", choices=["impressions", "clicks"],
                   help="the files are an impression or a click log (request_id, ts in epoch ms, and for "
                        "impressions user_id, item_id and the spec's columns), written as the event streams the "
                        "events source joins, instead of a labelled click log")
    p.set_defaults(func=cmd_ingest)

    p = sub.add_parser("datasets", parents=[common], help="fetch a real public log as a CSV to ingest")
    p.add_argument("action", choices=["fetch"])
    p.add_argument("name", choices=["movielens", "obd"])
    p.add_argument("--out", help="folder of the CSV (default <data_root>/datasets)")
    p.add_argument("--cache", help="folder of the downloaded wheels (default <out>/wheels)")
    p.add_argument("--policy", default="both", choices=["random", "bts", "both"], help="obd: the logging policy")
    p.add_argument("--campaign", default="all", choices=["all", "men", "women"], help="obd: the campaign")
    p.set_defaults(func=cmd_datasets)

    p = sub.add_parser("run", parents=[common], help="run a pipeline without Airflow")
    p.add_argument("pipeline", choices=["daily", "incremental"])
    p.add_argument("--date", help="the UTC day to process, YYYY-MM-DD")
    p.add_argument("--minute", help="the UTC minute to process (incremental), e.g. 2026-01-02T00:05")
    p.add_argument("--start")
    p.add_argument("--end")
    p.add_argument("--steps", help="comma-separated subset of steps, e.g. train,evaluate")
    p.add_argument("--run-id")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("trigger", parents=[common], help="trigger a DAG run through the Airflow REST API")
    p.add_argument("pipeline", choices=["daily", "incremental"])
    p.add_argument("--minute", help="incremental: the minute to learn (its start); daily: the day's end, a UTC "
                                    "midnight (2026-01-02T00:00 runs the day of 2026-01-01); default: the last "
                                    "complete minute or day")
    p.add_argument("--api-url", help="the Airflow API server (default: $CTR_AIRFLOW_API_URL, which `ctr stack env` "
                                     "sets, else http://localhost:8080)")
    p.add_argument("--unpause", action="store_true", help="unpause the DAG first (DAGs start paused)")
    p.add_argument("--param", action="append", metavar="SECTION.KEY=VALUE", help="config override for this run")
    p.set_defaults(func=cmd_trigger)

    p = sub.add_parser("rollback", parents=[common], help="move serving and minute runs back to VERSION")
    p.add_argument("version")
    p.add_argument("--reason", default="manual rollback")
    p.set_defaults(func=cmd_rollback)

    p = sub.add_parser("promote", parents=[common], help="label a version stable (TF Serving's version labels)")
    p.add_argument("version", nargs="?", help="the version to promote (default: the newest standing one)")
    p.add_argument("--reason", default="manual promotion")
    p.set_defaults(func=cmd_promote)

    p = sub.add_parser("tables", parents=[common], help="the table report of a version in the model store: rows in "
                       "use, new, evicted, waiting for admission, touched, frequencies, norms, rare-row reads")
    p.add_argument("version", nargs="?", help="the version (default: the newest standing one)")
    p.add_argument("--json", action="store_true", help="the whole report as JSON")
    p.set_defaults(func=cmd_tables)

    p = sub.add_parser("serve", parents=[common], help="serve the newest published model")
    p.add_argument("--host")
    p.add_argument("--port", type=int, help="REST API port (default 8501)")
    p.add_argument("--grpc-port", type=int, help="gRPC API port (default 8500; -1: REST only)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("spark-connect", parents=[common], help="run a Spark Connect server (SPARK_REMOTE)")
    p.add_argument("--port", type=int)
    p.set_defaults(func=cmd_spark_connect)

    p = sub.add_parser("worker", parents=[common], help="run minute-run steps for Airflow's tasks in one warm "
                                                        "process")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only); clients "
                                                       "must hold CTR_STEP_WORKER_SECRET, as the worker does")
    p.add_argument("--port", type=int, default=0, help="TCP port (default: any free one, announced in "
                                                       "<data_root>/worker/step-worker.json)")
    p.add_argument("--advertise", help="the host name tasks connect to (default: --host), e.g. the service's "
                                       "name when it listens on 0.0.0.0 in a container")
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("airflow", parents=[common], help="the Airflow CLI on the project's embedded settings")
    p.add_argument("airflow_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_airflow)

    p = sub.add_parser("ui", parents=[common], help="start the Airflow or MLflow UI on this data")
    p.add_argument("which", choices=["airflow", "mlflow"])
    p.add_argument("--port", type=int)
    p.set_defaults(func=cmd_ui)

    p = sub.add_parser("tracking", parents=[common], help="tracking calls kept while the MLflow server was away")
    p.add_argument("action", choices=["status", "flush"], help="status: what waits; flush: deliver it now")
    p.set_defaults(func=cmd_tracking)

    p = sub.add_parser("stack", help="the production topology (Airflow, MLflow, S3, Spark Connect, serving) as "
                                     "processes on this machine")
    p.add_argument("action", choices=["up", "down", "status", "logs", "env"])
    p.add_argument("service", nargs="?", help="logs: one service's log (default: all)")
    p.add_argument("-n", "--lines", type=int, default=40, help="logs: lines from the end")
    p.add_argument("-f", "--follow", action="store_true", help="logs: keep printing")
    p.add_argument("--purge", action="store_true", help="down: also drop its databases and delete its home")
    p.set_defaults(func=cmd_stack)
    return parser


# What main says for each error the commands raise on bad input or an unreachable service, and its exit code.
ERRORS = {ConfigError: ("configuration error", 2), ModelStoreError: ("model store", 1), StackError: ("stack", 1),
          TriggerError: ("airflow", 1), DataValidationError: ("validation", 1)}


def main(argv: list[str] | None = None) -> int:
    _setup_logging()
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, ModelStoreError, StackError, TriggerError, DataValidationError) as err:
        what, code = next(entry for kind, entry in ERRORS.items() if isinstance(err, kind))
        print(f"{PROG}: {what}: {err}", file=sys.stderr)
        return code


def deprecated_main(argv: list[str] | None = None) -> int:
    """`ctr`, the command's former name: the same command, after a notice on stderr. containerd ships a `ctr` on
    every Docker host and Kubernetes node, so a shell whose PATH finds that one first runs the wrong program."""
    print(f"ctr: this command is now called {PROG} ({PROG} {' '.join(sys.argv[1:] if argv is None else argv)}); "
          f"'ctr' stays as an alias for this release only (containerd's own 'ctr' takes the name on Docker hosts "
          "and Kubernetes nodes)", file=sys.stderr)
    return main(argv)


if __name__ == "__main__":
    sys.exit(main())
