"""What the agent and training processes share: the wire, tar reading, errors.

The wire protocol (:mod:`.protocol`), the cache directory's layout and index as
both sides see them (:mod:`.layout`, :mod:`.index`), the URL list (:mod:`.urls`,
:mod:`.s3` for object-store listings), the epoch's sample order (:mod:`.sequence`,
:mod:`.plan`), tar reading (:mod:`.tarwalk`, :mod:`.samples`), the agent's
options (:mod:`.config`), the client of the control socket (:mod:`.client`),
stats (:mod:`.stats`) and the error hierarchy (:mod:`.errors`).
"""
