"""Sampled verification of store hits: are the answers a replica served from the store the ones it computes?

The fingerprint is only as good as what it hashes: under ``fingerprint.weights: headers`` two checkpoints of one
shape share a namespace, and a kernel or driver change can alter KV without changing any field. With
``verify: {sample: 0.01}`` in the policy, the connector sets aside a sampled fraction of the requests that
loaded from the store (:mod:`prefixshare.runtime._verify`); later, when the engine is idle::

    with PrefixShare("policy.yaml") as ps:
        llm = ps.attach({...})
        ...                                    # serve requests
        report = ps.verify()                   # or prefixshare.verify.verify_pending(ps, llm, budget_s=5)
        print(report.summary())

each set-aside prompt is replayed twice on the replica that served it, loaded from the store and recomputed
without it (fresh engine cache salts: the replica's prefix cache serves neither), and their first tokens'
log-probabilities are compared (:mod:`._compare`, tolerance by KV dtype). A mismatch quarantines the chunks the
request loaded (:mod:`._quarantine`), logs ``store.verify_mismatch``, counts in ``ps.stats()["verify"]`` and the
``prefixshare_verify_total`` metric, and is listed by ``prefixshare doctor``.

Replicas behind ``vllm serve`` are replayed over their HTTP API (:class:`ServedReplica`, ``prefixshare verify
--url``); the store's warmed documents can be verified offline too (:func:`verify_documents`, ``prefixshare
verify --model``).
"""

from prefixshare.verify._compare import Comparison, compare
from prefixshare.verify._documents import verify_documents
from prefixshare.verify._quarantine import RECORDS_DIR, Quarantined, loaded_chunk_hashes, mismatch_records, quarantine
from prefixshare.verify._run import Check, Replayer, VerifyReport, check_task, verify_pending, verify_tasks
from prefixshare.verify._served import ServedReplica, parse_completion

__all__ = [
    "RECORDS_DIR",
    "Check",
    "Comparison",
    "Quarantined",
    "Replayer",
    "ServedReplica",
    "VerifyReport",
    "check_task",
    "compare",
    "loaded_chunk_hashes",
    "mismatch_records",
    "parse_completion",
    "quarantine",
    "verify_documents",
    "verify_pending",
    "verify_tasks",
]
