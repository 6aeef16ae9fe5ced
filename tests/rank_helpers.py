"""`lanes serve` as real processes, from a Trio test: each process's stderr read line by line as it comes,
its URL taken from the "serving ... on" line, and its exit awaited with a bound."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import trio

from lanes.launch import free_port


class Served:
    """One `lanes serve` process: its stderr lines so far, its URL once it serves, its exit code once it ends."""

    def __init__(self, process: trio.Process, name: str) -> None:
        self.process = process
        self.name = name
        self.lines: list[str] = []
        self.url: str | None = None
        self.serving = trio.Event()
        self.ended = trio.Event()

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    async def read(self) -> None:
        buffer = b""
        async for chunk in self.process.stderr:
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for raw in lines:
                line = raw.decode(errors="replace")
                self.lines.append(line)
                if self.url is None and "INFO lanes: serving " in line:
                    self.url = line.rsplit(" on ", 1)[1].strip()
                    self.serving.set()
        if buffer:
            self.lines.append(buffer.decode(errors="replace"))
        await self.process.wait()
        self.ended.set()
        self.serving.set()  # nobody waits for a URL that will never come

    async def until_serving(self) -> str:
        await self.serving.wait()
        assert self.url is not None, f"{self.name} ended ({self.process.returncode}) before serving:\n{self.text}"
        return self.url

    async def exit_code(self) -> int:
        await self.ended.wait()
        return self.process.returncode

    def signal(self, number: int) -> None:
        if self.process.returncode is None:
            self.process.send_signal(number)


async def start(nursery: trio.Nursery, folder: Path, *flags: str, name: str = "lanes") -> Served:
    """Start `python -m lanes serve` on the tiny model in `folder` (CPU, fp32, port 0) with `flags`."""
    command = [sys.executable, "-m", "lanes", "serve", "--model", str(folder), "--device", "cpu", "--dtype", "fp32",
               "--port", "0", "--max-model-len", "512", *flags]
    process = await trio.lowlevel.open_process(command, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    served = Served(process, name)
    nursery.start_soon(served.read)
    return served


async def start_two_ranks(nursery: trio.Nursery, folder: Path, *flags: str) -> tuple[Served, Served, str]:
    """Ranks 0 and 1 of `--tp 2` as two processes with `flags`, once rank 0 serves: (rank 0, rank 1, its URL)."""
    ranks = ["--tp", "2", "--master", "127.0.0.1", "--master-port", str(free_port()), *flags]
    rank0 = await start(nursery, folder, *ranks, "--rank", "0", name="rank 0")
    rank1 = await start(nursery, folder, *ranks, "--rank", "1", name="rank 1")
    return rank0, rank1, await rank0.until_serving()


def children_of(pid: int) -> list[int]:
    """The live processes whose parent is `pid` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


async def gone(pid: int) -> None:
    """Returns when process `pid` (not necessarily our child) has ended: its pidfd turns readable."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        await trio.lowlevel.wait_readable(fd)
    finally:
        os.close(fd)
