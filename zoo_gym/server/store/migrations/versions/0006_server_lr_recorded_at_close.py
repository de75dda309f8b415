"""sync rounds: the server learning rate a round was closed with

RoundInputs.server_lr: the factor on the round's aggregate (`--server-lr`; the new base is base + server_lr x
aggregate), recorded when the round closes so that a redo after a crash publishes the same bytes whatever the
flag says later. Null = closed by an older version: a synchronous round then steps by 1, as it did (an async
flush reads its own figure from staleness_json), so existing rows need nothing.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-29 06:30:00.000000

"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa


# revision identifiers, used by Alembic.
revision: str = '0006'
down_revision: Union[str, Sequence[str], None] = '0005'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    """Upgrade schema."""
    with op.batch_alter_table('roundinputs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('server_lr', sa.Float(), nullable=True))


def downgrade() -> None:
    """Downgrade schema."""
    with op.batch_alter_table('roundinputs', schema=None) as batch_op:
        batch_op.drop_column('server_lr')
