"""The search: NAS over morph candidates (nas, arch, gp), HPO (hpo), learning-curve prediction
(curve) and the shared history of finished trials (history). See docs/search.md."""
