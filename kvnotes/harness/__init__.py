"""What the probes share: prompts, tokens and spans (:mod:`.tokens`), clean/corrupted pairs
(:mod:`.pairs`), the decision readout (:mod:`.readout`), the probe kit (:mod:`.kit`), selection and
statistics, the probe registry and :class:`~kvnotes.harness.registry.ProbeContext`, run-config checks
and the job path (:mod:`.jobs`)."""
