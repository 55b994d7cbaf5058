from tests.hub_server import hub, hub_repos  # noqa: F401  (the fixtures)
