"""async rounds: staleness of each buffered delta

RoundInputs.staleness_json (`gym-server serve --mode async`): the flush's server learning rate, staleness
exponent and each delta's staleness and weight, recorded when the buffer closes so a redo pays the same.
Null for synchronous rounds, so existing rows need nothing.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23 14:25:37.619202

"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa


# revision identifiers, used by Alembic.
revision: str = '0003'
down_revision: Union[str, Sequence[str], None] = '0002'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    """Upgrade schema."""
    with op.batch_alter_table('roundinputs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('staleness_json', sa.String(), nullable=True))


def downgrade() -> None:
    """Downgrade schema."""
    with op.batch_alter_table('roundinputs', schema=None) as batch_op:
        batch_op.drop_column('staleness_json')

