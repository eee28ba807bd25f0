"""`outlast dashboard`: a read-only web view of the cluster and of every run's life (docs/dashboard.md).

Its server and assets come with the `outlast[dashboard]` extra; the command says so when they are
missing. Every fact it shows is read through the readers `outlast runs` and `outlast status` use.
"""
