"""Command-line tools over the same builder the job uses: ``bagel-data`` (``cli``), ``inspect`` (``inspection``)
and ``stats`` (``budget_stats``). Nothing in the runtime imports them."""
