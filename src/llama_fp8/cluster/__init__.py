"""Running on a cluster, one folder per job: ``launch/`` starts and supervises jobs (the ``launch`` and
``submit`` commands, the elastic agent, the batch scripts' shell library, the A/B run order, the container
mounts), ``nodes/`` checks nodes (``preflight`` and its node, config and network checks), ``ngc.py`` pins the
image's versions (the NGC/EFA table)."""
