"""Alembic's environment for `python -m zoo_gym.server.store.migrations new` (autogenerate against a database
at the head). The server itself applies migrations through zoo_gym.server.store.migrations.upgrade."""

from alembic import context

from zoo_gym.server.store.migrations import target_metadata



def render_item(type_, obj, _autogen_context):
    """SQLModel's column types written as the plain SQLAlchemy types they store, so a revision does not
    depend on SQLModel's internals."""
    import sqlmodel.sql.sqltypes as sqltypes

    if type_ == "type" and isinstance(obj, sqltypes.AutoString):
        return f"sa.String(length={obj.length})" if obj.length else "sa.String()"
    if type_ == "type" and isinstance(obj, getattr(sqltypes, "UTCDateTime", ())):
        return "sa.DateTime(timezone=True)"
    return False


connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=target_metadata(), render_as_batch=True,
                  compare_type=True, render_item=render_item)
with context.begin_transaction():
    context.run_migrations()
