"""HTTP: routes, the event stream, request bodies, auth, the OpenAPI document, the dashboard."""
