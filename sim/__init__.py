"""A discrete-event simulator of a swarm: our own routing, span choice, rebalancing and bans over N simulated nodes.

It imports the pure decision code (``gateway.swarm.routing``, ``swarm_node.span_choice``, ``gateway.swarm.bans``)
and runs it under a virtual clock: heterogeneous GPUs (``hardware``), a geography of RTTs (``geography``), churn and
requests (``workload``), a fluid data plane (``dataplane``) and the bound to compare with: the path LP over chains
(``route_plan.path_lp``), and the per-node max-flow relaxation it tightens (``flow_bound``).
Nothing async and no hivemind, torch or web stack (an import-linter contract); ``python -m sim`` runs the scenarios
and writes ``bench/results/sim.md``. Every modelling assumption is in ``sim/ASSUMPTIONS.md``.
"""
