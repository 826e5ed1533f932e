"""Put first on ``PYTHONPATH`` by ``bench/workers.py --merge-appends off|both``: every
process of the server it starts (the parent and each worker, which inherit the
environment) sends its appends to the storage node one call each, as before appends
were merged (``storage/remote_appends.py``), so both can be measured side by side
from one checkout. Python imports ``sitecustomize`` at start-up when it is on the path."""

from polymq.storage import remote

remote.MERGE_APPENDS = False
