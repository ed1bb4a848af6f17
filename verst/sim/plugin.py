"""The plug-in that registers the simulation's engine kind and weight transport (`verst.sim.kinds`); `verst sim`
lists it in the run's `plugins`. A run of another command may list it too: its engines are then simulated
ones, one server each (`python -m verst.sim.serve`)."""

from __future__ import annotations

from verst.sim.kinds import register

register()
