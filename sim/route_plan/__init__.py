"""Routing by a plan, in the simulator: the path LP over the swarm's chains (``path_lp``, priced by ``chains``; the
bound ours is judged against), and sessions drawn onto the chains of a plan (``planned``, ``view_plan``). Pure code
over arrays, run at a thousand nodes. The gateway's router does not route by a plan (``bench/README.md``, stop 43:
at most 1.05x from what a gateway can know), so it lives here, and scipy is the simulator's dependency only."""
