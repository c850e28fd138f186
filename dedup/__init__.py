"""Receiving: which records are new, and committing "seen" together with their effect.

:mod:`~.bloom` rotating Bloom filters; :mod:`~.trust` when they may be believed;
:mod:`~.admission` Bloom first, Redis for "maybe"s; :mod:`~.commit` the atomic commit of
seen-marks, backup, state and journal; :mod:`~.delivery` sinks' delivered-marks;
:mod:`~.state` keyed state; :mod:`~.guard` the task hooks composed from these;
:mod:`~.config` the settings (:class:`~.config.DedupConfig`).
"""
