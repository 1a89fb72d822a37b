"""The Energon side of the BAGEL runtime, by concern: ``layout`` (the on-disk contract of a converted dataset, shared
with the converter, which writes it), ``cooking`` (a crude converted sample into the official per-sample dict,
``BagelSample``, per group), ``readers`` (one reader core; the orders as plans: ``elastic``, the default, and
``official``, the parity order), ``patches`` (code that re-implements Energon internals, in one place, used on the
Energon versions it is tested against only).

Importing this package imports nothing heavy: ``layout`` needs numpy only; the readers need torch and Energon.
"""
