"""Command-line pieces of the fabric model, shared by the commands that show and check it.

:mod:`topology.cli.sources` holds the options that choose what to probe (this
host, a captured fixture, captured files) and turns them into a topology. The
commands themselves, ``neocomm topo`` and ``neocomm fabric``, gather every host
of a job and measure its links over the runtime, so they live with the runtime
(``neocomm/cli``) and hand plain values (a communicator, node numbers,
measured GB/s) down to this layer.
"""
