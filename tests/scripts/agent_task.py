"""An agent's two-step task, as a real process: run it, kill it anywhere, run it again."""

from __future__ import annotations

import asyncio
import json
import sys

from jobtrail import AsyncJobtrail

STEPS = ("start-export", "notify-owner")


async def main(db: str, config: dict) -> None:
    async with AsyncJobtrail(db, providers=[config]) as jt:
        task = await jt.task("nightly-export", caller="agent-7")
        for name in STEPS:
            await task.step(name, provider=config["name"], request={"step": name})
        for name in STEPS:
            view = await task.run(name, {"step": name})
            if view.state != "confirmed":
                break  # an unresolved step is never repeated automatically: a person decides
        print(json.dumps(task.explain()))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], json.loads(sys.argv[2])))
