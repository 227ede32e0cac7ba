"""A job across several hosts: the `hosts` config section (config.py), the Monarch host mesh the controller attaches
to over them (host_mesh.py), and the agent every host runs (`python -m forge.hosts.agent`, agent.py)."""
