"""Fair queueing across workers: admission, tenant queues and fair share, in Redis
(docs/protocol.md, "Tenants, batch jobs and admission"; issue 38).

Producers add jobs to the request stream as always. Every worker admits what arrives
there (`Admission`, admission.py): one script checks the caps and quotas and either
refuses the job or moves it into its tenant's queue at its level (a priority, or
`batch`). Workers take jobs from those queues (`FairQueueReader`, reader.py, a drop-in
for `JobReader`): the level whose oldest job has waited longest (priority counted as a
head start), within it the tenant served least, batch jobs only when no interactive job
is queued. Tenants are charged for what they are served (`Charges`, charges.py), so
every worker orders by the same account (VTC).

Each tenant queue is a stream with the same consumer group, leases and takeovers as the
request stream; a job keeps its request entry id (its *origin*) for everything a producer
sees, so the worker names it by that id, and the reader translates. Every key shares
the request stream's hash slot (`{<requests stream>}:...`, keys.py), so each script is
atomic, on a Redis Cluster too. The scripts are service/lua/fair_queue_*.lua (scripts.py).
"""

from service.fair_queue.admission import Admissible, Admission, Refusal
from service.fair_queue.charges import Charges
from service.fair_queue.keys import BATCH_LEVEL, CountKeys, account_of, level_of
from service.fair_queue.reader import FairQueueReader

__all__ = [
    "BATCH_LEVEL",
    "Admissible",
    "Admission",
    "Charges",
    "CountKeys",
    "FairQueueReader",
    "Refusal",
    "account_of",
    "level_of",
]
