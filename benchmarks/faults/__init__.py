"""The fault campaign of ``python benchmarks/faults_campaign.py``: its trials (``trials``, ``corrupt``) and its
report (``report``)."""
