"""Serving kvnotes' experiments on vLLM.

- :mod:`kvnotes.serving.trace`: the prefix-cache experiment's request traces (in-place rewrite,
  erratum, hoist, cold), the harness's reference decisions and the aggregates;
- :mod:`kvnotes.serving.store`: the chunk store behind the KV connector: registered K/V runs,
  the segment plans a request names, their validation and assembly (RoPE re-positioning);
- :mod:`kvnotes.serving.arms`: the connector arms' requests (``composed``, ``edited``), registered
  into a store with the harness's model;
- :mod:`kvnotes.serving.connector`: the vLLM V1 KV connector itself (imports vLLM; the serving
  environment only).

The names of :mod:`kvnotes.serving.trace` are re-exported here; a serving record names this module
under ``presentation``.
"""

from kvnotes.serving.trace import (ARMS, POSITIONS, PRESENTATION, REFERENCES, SUMMARY_KEYS, Request, aggregate,
                                   build_trace, full_prefill_logprobs, percentile, pick_sessions, place,
                                   reference_decisions, session_values, shared_document, summarize_run)

__all__ = ["ARMS", "POSITIONS", "PRESENTATION", "REFERENCES", "SUMMARY_KEYS", "Request", "aggregate", "build_trace",
           "full_prefill_logprobs", "percentile", "pick_sessions", "place", "reference_decisions", "session_values",
           "shared_document", "summarize_run"]
