"""Records: the JSON envelope a run writes (:mod:`.store`), the typed results probes return
(:mod:`.schema`), tables from records (:mod:`.tables`) and the offline HTML report (:mod:`.report`).
Imports nothing from the harness: a reader of records needs no model."""
