"""What the probes share: prompts, tokens and spans (:mod:`.tokens`), clean/corrupted pairs
(:mod:`.pairs`), the direct decision readout (:mod:`.readout`; the generated one is
:mod:`kvnotes.kv.generate`), the probe kit (:mod:`.kit`), selection and
statistics, the probe registry and :class:`~kvnotes.harness.registry.ProbeContext`, run-config checks
and the job path (:mod:`.jobs`); and the machinery more than one probe, circuit or command uses:
head-output patching (:mod:`.head_patch`), chunked prompts (:mod:`.chunks`), the erratum and edit
prompts (:mod:`.edit_prompts`), paired tests (:mod:`.paired`), the memory experiments
(:mod:`.memory`), timing and the roofline floor. What one probe alone needs lives in that probe's
module (or package: ``probes/compose/``)."""
