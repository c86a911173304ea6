"""Routing by a plan: the path LP over the swarm's chains (``path_lp``, priced by ``chains``), and sessions drawn
onto the chains of its plan (``planned``). Pure code over arrays: the simulator runs it at a thousand nodes."""
