"""The peer for the drain benchmark: procrastinate's per-key ``lock`` drain on the same server.

    python bench/peer_procrastinate.py DSN USERS PER_USER CLIENTS WORKER_CONCURRENCY

Runs in a virtual environment of its own (bench/run.py makes it: procrastinate and psycopg are
not the service's dependencies). USERS x PER_USER jobs, each deferred with ``lock=<user>`` (no
two jobs of one user run at once, procrastinate's per-key serialization), by CLIENTS concurrent
deferrers, while one worker of WORKER_CONCURRENCY runs them; each job does nothing (Core answers
at once, as the simulator does in the service's drain). Timed from the first defer to the last
job succeeded, the same as the service's drain. Like autovacuum would, ANALYZE runs on the jobs
table before the clock starts and every second while it runs (the service's drain gets the
same). Prints one JSON line.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import procrastinate
import psycopg

ANALYZE_EVERY_S = 1.0


async def main(dsn: str, users_n: int, per_user: int, clients: int, concurrency: int) -> None:
    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=dsn))

    @app.task(name="analysis")
    async def analysis(n: int) -> None:
        return None

    total = users_n * per_user
    async with app.open_async():
        await app.schema_manager.apply_schema_async()
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            await conn.execute("ANALYZE procrastinate_jobs")
            work = [(f"p{u}", n) for n in range(per_user) for u in range(users_n)]
            cursor = 0

            async def deferrer() -> None:
                nonlocal cursor
                while cursor < len(work):
                    user, n = work[cursor]
                    cursor += 1
                    await analysis.configure(lock=user).defer_async(n=n)

            async def analyzer() -> None:
                async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as own:
                    while True:
                        await asyncio.sleep(ANALYZE_EVERY_S)
                        await own.execute("ANALYZE procrastinate_jobs")

            started = time.perf_counter()
            worker = asyncio.create_task(
                app.run_worker_async(
                    concurrency=concurrency,
                    wait=True,
                    listen_notify=True,
                    delete_jobs="never",
                    install_signal_handlers=False,
                )
            )
            analyzing = asyncio.create_task(analyzer())
            await asyncio.gather(*(deferrer() for _ in range(clients)))
            deferred_s = time.perf_counter() - started
            while True:
                cur = await conn.execute(
                    "SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'"
                )
                row = await cur.fetchone()
                if row is not None and row[0] >= total:
                    break
                await asyncio.sleep(0.02)
            wall = time.perf_counter() - started
            for task in (worker, analyzing):
                task.cancel()
            await asyncio.gather(worker, analyzing, return_exceptions=True)
            cur = await conn.execute(
                """SELECT coalesce(max(c), 0) FROM (
                       SELECT count(*) AS c
                         FROM procrastinate_jobs a
                         JOIN procrastinate_events sa ON sa.job_id = a.id AND sa.type = 'started'
                         JOIN procrastinate_jobs b ON b.lock = a.lock
                         JOIN procrastinate_events sb ON sb.job_id = b.id AND sb.type = 'started'
                         JOIN procrastinate_events eb ON eb.job_id = b.id
                                                     AND eb.type = 'succeeded'
                        WHERE sb.at <= sa.at AND eb.at > sa.at
                        GROUP BY a.id) s"""
            )
            row = await cur.fetchone()
            overlap = row[0] if row is not None else None
    print(
        json.dumps(
            {
                "jobs": total,
                "deferred_in_s": deferred_s,
                "drained_in_s": wall,
                "jobs_per_s": total / wall,
                "worker_concurrency": concurrency,
                "max_concurrency_per_lock": overlap,
                "procrastinate": procrastinate.__version__,
            }
        )
    )


if __name__ == "__main__":
    dsn, users, per_user, clients, concurrency = sys.argv[1:6]
    asyncio.run(main(dsn, int(users), int(per_user), int(clients), int(concurrency)))
