"""train.processes on the JAX backend: two training processes joined over loopback by
keras.distribution.initialize (trainer/processes.py) make one mesh whose table is sharded across the processes,
each holding its half while it trains, and train to the weights one process with one device gives."""

import dataclasses
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from tests.trainer.synthetic import random_rows, roc_auc, write_block_files
from tests.trainer.test_export import feature_state
from tests.trainer.test_jax_devices import rows_within
from tests.trainer.test_jax_train import CONFIG

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def one_and_two(tmp_path_factory):
    """The same batches (6,000 rows in batches of 200, one file, so one reader and the seeded order) trained by
    one process with one device and by two processes with one device each, the table sharded across them."""
    from components.schema import CATEGORICAL_FEATURES
    from trainer.jax_train import train_in_jax_process

    state = feature_state()
    sizes = [state.table_sizes()[name] for name in CATEGORICAL_FEATURES]
    root = tmp_path_factory.mktemp("processes-data")
    train_files = write_block_files(rows_within(random_rows(6000, 3, seed=1), sizes), root / "train", num_files=1,
                                    block_rows=500)
    eval_files = write_block_files(rows_within(random_rows(1500, 3, seed=2), sizes), root / "eval", num_files=1,
                                   block_rows=500)
    config = dataclasses.replace(CONFIG, batch_size=200, epochs=2, early_stopping_patience=2, calibrate=False,
                                 shard_table_rows=0)
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("XLA_FLAGS", raising=False)  # one CPU device a process
        runs = {processes: train_in_jax_process(
                    dataclasses.replace(config, processes=processes, devices=processes), state.table_sizes(),
                    train_files, eval_files, tmp_path_factory.mktemp(f"processes-{processes}") / "checkpoint",
                    num_rows=6000)
                for processes in (1, 2)}
    arguments = {"config": dataclasses.replace(config, processes=2, devices=2), "table_sizes": state.table_sizes(),
                 "train_files": train_files, "eval_files": eval_files, "num_rows": 6000}
    return runs, sum(state.table_sizes().values()), arguments


@pytest.mark.integration
def test_each_of_two_processes_holds_half_of_the_table(one_and_two):
    runs, rows, _ = one_and_two
    padded = -(-rows // 2) * 2
    two = runs[2].speed_flags
    assert (two["processes"], two["devices"]) == (2, 2)
    assert runs[1].speed_flags["processes"] == 1
    # The first process's shards of the table and of its Adagrad accumulator: half of each.
    assert two["shard_rows"] == {"table": [padded // 2], "optimizer": [padded // 2]}
    assert two["sharded_table_rows"] == padded
    assert runs[2].model.embedding.embeddings.shape[0] == padded  # the checkpoint holds the whole table


@pytest.mark.integration
def test_two_processes_train_to_the_weights_of_one(one_and_two):
    runs, rows, _ = one_and_two
    assert runs[1].global_step == runs[2].global_step == 60
    assert runs[1].num_train_examples == runs[2].num_train_examples == 6000
    for single, joined in zip(runs[1].model.weights, runs[2].model.weights, strict=True):
        assert single.path == joined.path
        expected, got = np.asarray(single), np.asarray(joined)
        if got.shape != expected.shape:  # the table: the padding row past `rows` is never read
            got = got[:rows]
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5, err_msg=single.path)
    np.testing.assert_allclose(runs[2].eval_predictions, runs[1].eval_predictions, atol=1e-5)
    # Early stopping ran on the first process's gathered copy: the same held-out scores by epoch.
    assert len(runs[2].history["val_auc"]) == 2
    np.testing.assert_allclose(runs[2].history["val_auc"], runs[1].history["val_auc"], atol=2e-3)


@pytest.mark.integration
def test_two_processes_killed_after_a_progress_save_resume_to_the_unbroken_weights(one_and_two, tmp_path):
    """The step and both of its processes SIGKILLed after a progress save (every 7 steps, gathered to the first
    process); run again, both processes load that save and end at the unbroken two-process run's weights."""
    from trainer.jax_train import train_in_jax_process

    runs, _, arguments = one_and_two
    checkpoint = tmp_path / "checkpoint"
    (tmp_path / "arguments.pkl").write_bytes(pickle.dumps({**arguments, "checkpoint_dir": checkpoint}))
    script = ("import pickle, sys; from trainer.jax_train import train_in_jax_process; "
              "train_in_jax_process(**pickle.loads(open(sys.argv[1], 'rb').read()))")
    env = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"}
    step = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "arguments.pkl")], cwd=REPO_ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    state_file = checkpoint / "progress" / "state.json"
    deadline = time.monotonic() + 240
    while step.poll() is None and time.monotonic() < deadline:
        if state_file.exists() and json.loads(state_file.read_text())["global_step"] >= 14:
            break
        time.sleep(0.05)
    os.killpg(step.pid, signal.SIGKILL)  # the step and both training processes
    step.wait()
    saved = json.loads(state_file.read_text())
    assert 14 <= saved["global_step"] < 60 and not (checkpoint / "manifest.json").exists()

    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("XLA_FLAGS", raising=False)
        resumed = train_in_jax_process(**arguments, checkpoint_dir=checkpoint)
    assert resumed.resumed_from_step == saved["global_step"]
    assert resumed.global_step == 60
    for unbroken, again in zip(runs[2].model.weights, resumed.model.weights, strict=True):
        np.testing.assert_allclose(np.asarray(again), np.asarray(unbroken), rtol=1e-5, atol=1e-6,
                                   err_msg=unbroken.path)


def four_hundred_rows(tmp_path: Path) -> tuple:
    """(the feature state, one block file of 400 rows within its tables): a step that fails before it trains."""
    from components.schema import CATEGORICAL_FEATURES

    state = feature_state()
    sizes = [state.table_sizes()[name] for name in CATEGORICAL_FEATURES]
    return state, write_block_files(rows_within(random_rows(400, 1, seed=1), sizes), tmp_path / "rows",
                                    num_files=1, block_rows=200)


@pytest.mark.integration
def test_a_process_that_fails_stops_the_others_and_says_why(tmp_path):
    """train.devices=1 cannot hold a mesh over two processes: both refuse, the step names the first to exit."""
    from trainer.jax_train import train_in_jax_process

    state, files = four_hundred_rows(tmp_path)
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("XLA_FLAGS", raising=False)
        with pytest.raises(RuntimeError, match=r"(?s)process \d of 2 of the JAX train step.*train.processes=2 trains "
                                               r"on the devices of every process: set train.devices to 0 or 2"):
            train_in_jax_process(dataclasses.replace(CONFIG, processes=2, devices=1, epochs=1), state.table_sizes(),
                                 files, files, tmp_path / "checkpoint", num_rows=400)


def write_samples(rows, directory: Path, sizes: list[int]) -> list[str]:
    """Block files of `sizes` rows each, and the samples manifest that names their rows, as the samples step
    writes them."""
    from components.manifest import write_manifest

    directory.mkdir(parents=True)
    bounds = np.cumsum([0, *sizes])
    paths = []
    for index, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        part = write_block_files(rows.slice(int(start), int(stop)), directory / f"part-{index}", 1, 100)[0]
        paths.append(str(Path(part).rename(directory / f"part-{index:05d}.tfrecord")))
        (directory / f"part-{index}").rmdir()
    write_manifest(directory, kind="samples", version="test", files=[Path(p).name for p in paths],
                   row_counts={"rows": int(bounds[-1])},
                   extra={"shards": [{"file": Path(p).name, "rows": n} for p, n in zip(paths, sizes, strict=True)]})
    return paths


@pytest.mark.integration
def test_two_processes_read_their_own_files_and_take_equal_steps(tmp_path):
    """With the samples manifest beside the files, each process reads only its share of the files (balanced by
    rows) and all take the same steps an epoch, whatever their rows: the step neither hangs nor fails."""
    from components.schema import CATEGORICAL_FEATURES
    from trainer.jax_train import train_in_jax_process
    from trainer.processes import assign_files

    state = feature_state()
    sizes = [state.table_sizes()[name] for name in CATEGORICAL_FEATURES]
    files = write_samples(rows_within(random_rows(6000, 3, seed=1), sizes), tmp_path / "train",
                          [1800, 1500, 1400, 1300])
    eval_files = write_block_files(rows_within(random_rows(1500, 3, seed=2), sizes), tmp_path / "eval", 1, 500)
    assert assign_files([1800, 1500, 1400, 1300], 2) == [[0, 3], [1, 2]]  # 3,100 and 2,900 rows
    config = dataclasses.replace(CONFIG, batch_size=200, epochs=2, early_stopping_patience=0, calibrate=False,
                                 shard_table_rows=0, processes=2, devices=2)
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("XLA_FLAGS", raising=False)
        run = train_in_jax_process(config, state.table_sizes(), files, eval_files, tmp_path / "checkpoint",
                                   num_rows=6000)
    flags = run.speed_flags
    # Batches of 100 rows a process, two readers each: min(31, 29) - 2 + 1 steps.
    assert (flags["process_files"], flags["steps_per_epoch"], flags["reader_workers"]) == ("split", 28, 2)
    assert run.global_step == 56 and run.num_train_examples == 28 * 200
    assert roc_auc(run.eval_labels, run.eval_predictions) > 0.75


@pytest.mark.integration
def test_the_equal_steps_are_steps_every_readers_share_can_give(tmp_path):
    """Each reader process drops its last partial batch, so a share yields at least floor(rows / batch) - readers
    + 1 full batches: checked against the parallel reader itself on files of uneven sizes."""
    from trainer.parallel_reader import parallel_block_batches
    from trainer.processes import assign_files, equal_steps

    rng = np.random.default_rng(3)
    sizes = [int(n) for n in rng.integers(150, 900, 7)]
    files = write_samples(random_rows(sum(sizes), 3, seed=4), tmp_path / "rows", sizes)
    shares = assign_files(sizes, 3)
    for workers in (1, 2, 3):
        steps = equal_steps(sizes, shares, 64, workers)
        for share in shares:
            yielded = sum(1 for _ in parallel_block_batches([files[i] for i in share], 64, workers, seed=1))
            assert yielded >= steps, (share, workers, yielded, steps)
            if workers == 1:  # one reader drops one partial batch: the bound is exact
                assert yielded == sum(sizes[i] for i in share) // 64


def start_as_a_scheduler(job: Path, count: int) -> list[subprocess.Popen]:
    """What a Kubernetes Indexed Job does (docker/kubernetes/train-job.yaml): once the train step's request is
    there, `count` processes of `python -m trainer.jax_train`, each told the job and its JOB_COMPLETION_INDEX."""
    from trainer.processes import ADDRESSES_ENV, COUNT_ENV, free_loopback_address

    deadline = time.monotonic() + 120
    while not (job / "request.pkl").exists():
        assert time.monotonic() < deadline, "the train step wrote no request"
        time.sleep(0.1)
    coordinator = free_loopback_address()
    env = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"}
    return [subprocess.Popen([sys.executable, "-m", "trainer.jax_train", str(job / "request.pkl"), str(job)],
                             cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             env={**env, "KERAS_BACKEND": "jax", ADDRESSES_ENV: coordinator, COUNT_ENV: str(count),
                                  "JOB_COMPLETION_INDEX": str(index)})
            for index in range(count)]


@pytest.mark.integration
def test_a_step_waits_for_the_processes_a_cluster_scheduler_starts(one_and_two, tmp_path):
    """train.launcher=scheduler: the step writes its request beside the checkpoint and waits; two processes
    started as an Indexed Job starts them train, and the step returns their run (the weights of the two-process
    run the step starts itself)."""
    from trainer.jax_train import train_in_jax_process

    runs, _, arguments = one_and_two
    config = dataclasses.replace(arguments["config"], launcher="scheduler", scheduler_timeout_s=240)
    with ThreadPoolExecutor(1) as pool:
        step = pool.submit(train_in_jax_process, **{**arguments, "config": config},
                           checkpoint_dir=tmp_path / "checkpoint")
        processes = start_as_a_scheduler(tmp_path / "checkpoint-job", 2)
        result = step.result(timeout=300)
    assert [process.wait(timeout=60) for process in processes] == [0, 0]
    assert result.speed_flags["processes"] == 2 and result.global_step == runs[2].global_step
    for expected, got in zip(runs[2].model.weights, result.model.weights, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-6, atol=1e-7)


@pytest.mark.integration
def test_a_scheduled_process_that_fails_fails_the_waiting_step_with_its_report(tmp_path):
    from trainer.jax_train import train_in_jax_process

    state, files = four_hundred_rows(tmp_path)
    config = dataclasses.replace(CONFIG, processes=2, devices=1, epochs=1, launcher="scheduler",
                                 scheduler_timeout_s=240)
    with ThreadPoolExecutor(1) as pool:
        step = pool.submit(train_in_jax_process, config, state.table_sizes(), files, files,
                           tmp_path / "checkpoint", num_rows=400)
        processes = start_as_a_scheduler(tmp_path / "checkpoint-job", 2)
        with pytest.raises(RuntimeError, match=r"(?s)a train process started by the cluster scheduler failed.*"
                                               r"train.processes=2 trains on the devices of every process"):
            step.result(timeout=300)
    for process in processes:
        process.kill()
        process.wait()


@pytest.mark.unit
def test_the_kubernetes_job_runs_the_train_step_as_the_processes_join():
    """docker/kubernetes/train-job.yaml names the variables trainer/processes.py reads and the command the
    waiting step tells the scheduler to run."""
    import yaml

    from trainer.processes import ADDRESSES_ENV, COUNT_ENV, JOB_INDEX_ENV

    service, job = yaml.safe_load_all((REPO_ROOT / "docker" / "kubernetes" / "train-job.yaml").read_text())
    assert service["kind"] == "Service" and service["spec"]["clusterIP"] == "None"
    spec = job["spec"]
    assert (job["kind"], spec["completionMode"]) == ("Job", "Indexed")  # Kubernetes sets JOB_COMPLETION_INDEX
    assert spec["completions"] == spec["parallelism"] == "${PROCESSES}"
    container = spec["template"]["spec"]["containers"][0]
    assert container["command"] == ["python", "-m", "trainer.jax_train", "${JOB_DIR}/request.pkl", "${JOB_DIR}"]
    env = {item["name"]: item["value"] for item in container["env"]}
    assert env[ADDRESSES_ENV] == "${JOB_NAME}-0.${JOB_NAME}:7476" and env[COUNT_ENV] == "${PROCESSES}"
    assert JOB_INDEX_ENV == "JOB_COMPLETION_INDEX" and env["KERAS_BACKEND"] == "jax"


@pytest.mark.unit
def test_each_process_keeps_its_share_of_every_global_batch():
    from trainer.processes import process_share

    batches = [({"ids": np.arange(8) + 10 * b}, np.arange(8) + 10 * b) for b in range(2)]
    shares = [list(process_share(batches, index, 4)) for index in range(4)]
    assert [labels.tolist() for labels in (shares[1][0][1], shares[3][1][1])] == [[2, 3], [16, 17]]
    joined = np.concatenate([shares[index][0][0]["ids"] for index in range(4)])
    assert joined.tolist() == list(range(8))
    with pytest.raises(ValueError, match="a global batch of 8 rows cannot be split evenly across 3 processes"):
        list(process_share(batches, 0, 3))


@pytest.mark.unit
def test_a_job_environment_without_its_coordinator_is_refused(monkeypatch):
    from trainer.processes import COUNT_ENV, INDEX_ENV, join_from_environment, process_environment

    assert process_environment("10.0.0.1:1234", 2, 1) == {
        "KERAS_DISTRIBUTION_JOB_ADDRESSES": "10.0.0.1:1234", "KERAS_DISTRIBUTION_NUM_PROCESSES": "2",
        "KERAS_DISTRIBUTION_PROCESS_ID": "1"}
    with pytest.raises(ValueError, match=r"process 2 of 2: the index must be in \[0, 2\)"):
        process_environment("10.0.0.1:1234", 2, 2)
    monkeypatch.delenv(COUNT_ENV, raising=False)
    assert join_from_environment() == 1
    monkeypatch.setenv(COUNT_ENV, "2")
    monkeypatch.delenv(INDEX_ENV, raising=False)
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "1")  # a Kubernetes Indexed Job's pod
    with pytest.raises(ValueError, match="KERAS_DISTRIBUTION_NUM_PROCESSES=2 needs KERAS_DISTRIBUTION_JOB_ADDRESSES"):
        join_from_environment()
    assert os.environ[INDEX_ENV] == "1"
