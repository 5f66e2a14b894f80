import pytest

from turnout import Buffer


@pytest.fixture(autouse=True)
def restore_num_sms():
    """Buffer.num_sms is process-wide: no test may leak a change to the next."""
    saved = Buffer.num_sms
    yield
    Buffer.num_sms = saved
