"""sampling: the sample rate a round was closed with

RoundInputs.sample_rate: each person's probability of selection for the round (the --sample-rate in force and
the round's draws), recorded when it closes so that publishing, a redo after a crash and the accountant charge
what selection used, whatever --sample-rate says later. Null = closed by an older version (publishing then reads
the current setting, as before), so existing rows need nothing.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-27 02:35:00.000000

"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa


# revision identifiers, used by Alembic.
revision: str = '0005'
down_revision: Union[str, Sequence[str], None] = '0004'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    """Upgrade schema."""
    with op.batch_alter_table('roundinputs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('sample_rate', sa.Float(), nullable=True))


def downgrade() -> None:
    """Downgrade schema."""
    with op.batch_alter_table('roundinputs', schema=None) as batch_op:
        batch_op.drop_column('sample_rate')
