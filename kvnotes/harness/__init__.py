"""What the probes share: prompts, tokens and spans (:mod:`.tokens`), clean/corrupted pairs
(:mod:`.pairs`), the direct decision readout (:mod:`.readout`; the generated one is
:mod:`kvnotes.kv.generate`), the probe kit (:mod:`.kit`), selection and
statistics, the probe registry and :class:`~kvnotes.harness.registry.ProbeContext`, run-config checks
and the job path (:mod:`.jobs`); and the executors a probe hands its declared interventions to:
head-output patching (:mod:`.head_patch`), residual-stream directions (:mod:`.steering`), direct logit
attribution (:mod:`.attribution`), composed readouts (:mod:`.composed`), the edit registry's source
for a pair (:mod:`.pair_editor`), an agent's trajectory inputs (:mod:`.trajectory`), the memory
experiments (:mod:`.memory`) and LoCoMo QA (:mod:`.locomo`)."""
