import pytest
import redis
from _tier_redis_helpers import describe, payload, slot


@pytest.fixture
def two_tenants(store):
    a, b = payload(1000), payload(2000)
    store.put(slot(1), a, describe(slot(1), a, tenant="a"))
    store.put(slot(2), b, describe(slot(2), b, tenant="b"))
    return store, a, b


def test_tenants_live_under_separate_key_prefixes(two_tenants):
    store, _, _ = two_tenants
    assert store.key_of(slot(1), "a").startswith(f"{store.prefix}:a:".encode())
    assert store.key_of(slot(2), "b").startswith(f"{store.prefix}:b:".encode())


def test_a_tenant_view_reads_only_its_own_keys(two_tenants):
    store, a, b = two_tenants
    view_a, view_b = store.for_tenant("a"), store.for_tenant("b")
    assert bytes(view_a.get(slot(1)).payload) == a and slot(1) in view_a
    assert view_a.get(slot(2)) is None and slot(2) not in view_a  # b's slot, looked up under a's prefix
    assert bytes(view_b.get(slot(2)).payload) == b and view_b.get(slot(1)) is None


def test_the_server_refuses_another_tenants_keys_to_a_tenant_user(two_tenants, redis_server):
    store, a, _ = two_tenants
    user_a = store.grant("a", "pw-a")
    try:
        view_a = store.for_tenant("a", username=user_a, password="pw-a")
        assert bytes(view_a.get(slot(1)).payload) == a  # its own keys: allowed
        with pytest.raises(PermissionError, match="no permissions"):
            view_a.read_key(store.key_of(slot(2), "b"))  # b's exact key, through a's credentials
        # A view built with the wrong tenant but a's credentials (a bug) is refused by the server too.
        wrong = store.for_tenant("b", username=user_a, password="pw-a")
        with pytest.raises(PermissionError):
            wrong.get(slot(2))
        raw = redis.Redis(host="127.0.0.1", port=redis_server.port, username=user_a, password="pw-a")
        with pytest.raises(redis.exceptions.NoPermissionError):
            raw.hgetall(store.key_of(slot(2), "b"))
        with pytest.raises(redis.exceptions.NoPermissionError):
            raw.scan()  # no listing of other tenants' key names either
        raw.close()
        view_a.close()
        wrong.close()
    finally:
        redis_server.client().execute_command("ACL", "DELUSER", user_a)


def test_tenant_names_cannot_reach_into_each_other(store, redis_server):
    # Tenant `a`'s key pattern must not cover tenant `a:b` (names may hold ':'), nor glob characters leak.
    data = payload(10)
    store.put(slot(3), data, describe(slot(3), data, tenant="a:b"))
    user_a = store.grant("a", "pw")
    try:
        view = store.for_tenant("a", username=user_a, password="pw")
        with pytest.raises(PermissionError):
            view.read_key(store.key_of(slot(3), "a:b"))
        view.close()
        assert bytes(store.for_tenant("a:b").get(slot(3)).payload) == data
        assert store.for_tenant("a").get(slot(3)) is None
    finally:
        redis_server.client().execute_command("ACL", "DELUSER", user_a)
