"""The storage tier never serves wrong KV and survives disk and process faults.

Real servers on torch_cpu with SGLang's `file` tier in a real directory, under the
plugin's integrity wrapper (on by default): damaged page files are misses that are
recomputed, counted and rewritten; a killed server's leftovers never reach a
restarted one; a full disk pauses writes while device and host keep serving.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import requests

from sgl_importance.client import metrics_text
from sgl_importance.local_server import metric
from support.server import launch_and_fail, output_ids_and_logprobs

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CORRUPT = "sgl_importance:storage_corrupt_pages_total"
# Float32 pinned: the point is bit-exact reuse (what a fault left intact answers as computed);
# in bfloat16 a prefix prefilled at once and one read back before an extend need not give the
# same greedy tokens (docs/testing.md).
ARGS = [
    "--dtype", "float32",
    "--page-size", "16",
    "--max-total-tokens", "1024",
    "--enable-hierarchical-cache",
    "--hicache-ratio", "4",
    "--hicache-storage-backend", "file",
    "--attention-backend", "importance_torch",
    "--radix-eviction-policy", "importance",
    "--enable-metrics",
    "--enable-cache-report",
]  # fmt: skip


def document(i: int) -> str:
    # ~600 tokens: two of them overflow the 1024-token device pool.
    return f"Report {i}: " + " ".join(f"entry{i}y{j}" for j in range(110))


def pages(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.suffix == ".bin")


def wait_for(condition, timeout: float = 120.0, what: str = "condition") -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if condition():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def corrupt_count(server) -> float:
    return metric(metrics_text(server.url, timeout=30), CORRUPT)


def flush(server) -> None:
    # SGLang refuses a flush (400) while storage writes or prefetches are in flight.
    wait_for(
        lambda: requests.post(server.url + "/flush_cache", timeout=60).status_code == 200,
        what="/flush_cache to be accepted",
    )


def storage_tokens(response: dict) -> int:
    details = response["meta_info"].get("cached_tokens_details") or {}  # None when nothing was cached
    return details.get("storage", 0)


def from_storage(server, i: int) -> dict:
    """Ask for document i with device and host emptied, so any cached prefix comes from storage."""
    flush(server)
    return server.generate(document(i))


@pytest.fixture(scope="module")
def restarted(launch, tmp_path_factory):
    """A server that wrote the file tier and was SIGKILLed, and a second one on its directory.

    Returns (second server, directory, greedy outputs of the first server, leftovers planted).
    """
    directory = tmp_path_factory.mktemp("tier") / "not-yet-there"
    env = {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(directory)}
    first = launch(ARGS, env)
    reference = {i: output_ids_and_logprobs(first.generate(document(i))) for i in (0, 1, 2)}
    wait_for(lambda: len(pages(directory)) >= 30, what="pages of three documents on disk")
    # Killed while writing: this request's pages go to disk as the kill lands.
    requests.post(
        first.url + "/generate", json={"text": document(3), "sampling_params": {"max_new_tokens": 1}}, timeout=300
    )
    os.killpg(first.proc.pid, signal.SIGKILL)
    first.stop()
    # What a kill can leave: an unfinished temporary file, and (on a file system
    # without atomic rename) a page cut short.
    (directory / ".0f0f0f0f0f0f.tmp").write_bytes(b"\x00" * 1000)
    victim = pages(directory)[0]
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    second = launch(ARGS, env)
    return second, directory, reference, victim


def test_killed_server_leaves_no_temporary_files_after_restart(restarted):
    _, directory, _, _ = restarted
    assert [p.name for p in directory.iterdir() if p.name.endswith(".tmp")] == []


def test_restarted_server_answers_seen_prompts_like_a_fresh_one_from_storage(restarted):
    server, _, reference, _ = restarted
    from_disk = 0
    for i in (0, 1, 2):
        out = from_storage(server, i)
        ids, logprobs = output_ids_and_logprobs(out)
        assert ids == reference[i][0], i
        assert logprobs == pytest.approx(reference[i][1], abs=1e-5)
        from_disk += storage_tokens(out)
    # Pages written before the kill are served (the cut-short one is refused, not read).
    assert from_disk > 0


def test_damaged_page_files_are_recomputed_counted_and_rewritten(restarted):
    server, directory, reference, _ = restarted
    out = from_storage(server, 0)
    assert storage_tokens(out) > 0
    before = corrupt_count(server)
    damaged = pages(directory)
    for n, path in enumerate(damaged):
        data = bytearray(path.read_bytes())
        if n % 3 == 0:
            data[len(data) // 3] ^= 0xFF  # a flipped byte
            path.write_bytes(bytes(data))
        elif n % 3 == 1:
            path.write_bytes(bytes(data[: len(data) // 2]))  # truncated
        else:
            path.write_bytes(bytes(len(data)))  # zero-filled

    out = from_storage(server, 0)
    ids, logprobs = output_ids_and_logprobs(out)
    assert ids == reference[0][0]
    assert logprobs == pytest.approx(reference[0][1], abs=1e-5)
    assert storage_tokens(out) == 0
    assert corrupt_count(server) > before

    # The recomputed pages are written again, and served from storage once more.
    wait_for(
        lambda: storage_tokens(from_storage(server, 0)) > 0,
        what="document 0 served from rewritten pages",
    )
    again = from_storage(server, 0)
    assert output_ids_and_logprobs(again)[0] == reference[0][0]
    log = server.log()
    refused = [line for line in log.splitlines() if "storage page refused" in line]
    assert refused and all(str(directory) in line for line in refused)
    assert len(refused) == len({line.rsplit(": ", 1)[-1] for line in refused}), "a file was logged twice"


def test_regular_file_at_the_storage_path_stops_start_up_naming_it(model_path, tmp_path, monkeypatch):
    path = tmp_path / "hicache"
    path.write_text("not a directory")
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(path))
    out = launch_and_fail(model_path, "--enable-hierarchical-cache", "--hicache-storage-backend", "file")
    assert f"storage directory {str(path)!r} is not a directory (a regular file is there)" in out


@pytest.fixture
def tiny_disk(tmp_path):
    """A 1 MiB tmpfs (two pages): the storage tier fills up almost at once."""
    directory = tmp_path / "tiny"
    directory.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(directory)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {proc.stderr.strip()}")
    yield directory
    subprocess.run(["umount", "-l", str(directory)], check=False)


def test_full_disk_pauses_writes_once_keeps_serving_and_resumes_when_space_returns(launch_here, tiny_disk):
    server = launch_here(
        [*ARGS, "--importance-storage-retry-s", "2"],
        {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(tiny_disk)},
    )
    reference = {}
    for i in (0, 1, 2):
        reference[i] = output_ids_and_logprobs(server.generate(document(i)))
        assert requests.get(server.url + "/health", timeout=30).status_code == 200
    wait_for(lambda: "storage tier writes paused" in server.log(), what="the pause warning")
    # Device and host still serve what they hold; nothing written before the disk filled is lost.
    again = server.generate(document(2))
    assert output_ids_and_logprobs(again)[0] == reference[2][0]
    assert again["meta_info"]["cached_tokens"] > 0
    kept = pages(tiny_disk)
    for _ in range(2):
        server.generate(document(0))
        time.sleep(2.5)  # past the retry delay: writes are retried and fail again
    assert server.log().count("storage tier writes paused") == 1
    assert set(kept) <= set(pages(tiny_disk))

    subprocess.run(["mount", "-o", "remount,size=64m", str(tiny_disk)], check=True)
    time.sleep(2.5)  # past the retry delay, so the next write is tried
    server.generate(document(4))
    wait_for(lambda: len(pages(tiny_disk)) > len(kept) + 10, what="writes to resume after space returned")
    assert "storage tier writes resumed" in server.log()
    assert requests.get(server.url + "/health", timeout=30).status_code == 200
    out = from_storage(server, 4)
    assert storage_tokens(out) > 0
