"""The plan as data: ``Plan`` (``plan``), the one style table (``styles``), rows and local widths
(``rows``), per-channel answers (``channels``), local head geometry (``local_geometry``), dropout
call sites (``call_sites``) and the ``shardlm plan`` table (``describe``). Imports ``model/`` only."""
