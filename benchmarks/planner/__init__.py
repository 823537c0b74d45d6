"""The planner's campaigns: published tables (``published``), their comparison (``published_report``), the layout
search on the published rows (``search_published``) and against measurement (``search``, ``search_report``,
``search_worker``), and re-predicting a stored measured campaign (``rescore``)."""
