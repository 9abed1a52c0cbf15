"""Template-collapse diagnostics: mutual-information proxies and gradient decomposition."""
