"""``rollout.close=all``: a step starts its ``sessions_per_step`` sessions (this rank's every
``size``-th) and closes once every one of them has ended."""

from __future__ import annotations

import asyncio

from toolkit.rollout.close.base import Landed, StepClose


class CloseAll(StepClose):
    async def collect(self, step: int, version: int = 0) -> Landed:
        self.open.step = step

        async def packed(index: int) -> None:
            # Packed as the session ends: its Python lists take ~60 B a token, the columns 9 B, so a
            # rank never holds a whole step of finished samples as lists.
            samples = await self.run(step, index, 0)
            if samples:
                await self.landed(step, samples[0].session_id)
            for sample in samples:
                sample.started_step = step
                self.builder.add(sample)
            if samples:
                self.open.forget(samples[0].session_id)

        await asyncio.gather(*(packed(i) for i in self.mine(step)))
        return self._hand_over(step)

    def mine(self, step: int) -> range:
        return range(self.rank, self.cfg.sessions_per_step, self.size)

    def sessions_to_close(self) -> int:
        return len(self.mine(0))
