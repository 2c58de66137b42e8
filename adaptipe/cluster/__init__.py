"""Gavel (seed 002, chapter 5): heterogeneity-aware allocation of jobs and job-arrays
across device types: the cluster and its jobs (`spec`), the policies as linear programs
(`policies`), the round-based mechanism that realises an allocation (`mechanism`) and a
trace-driven simulation of both (`simulate`)."""
